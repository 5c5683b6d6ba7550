"""Weight-only quantization: shared maths, the Linear swap, AWQ, checkpoints."""
