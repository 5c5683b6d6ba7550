"""The runtime: one model on one device, from token ids to token ids.

The core loop and its process, the scheduler, the paged KV cache, the model
runner, the sampler and speculative decoding; `model/` (architectures and
loading), `quant/` (weight quantization), `kernels/` (native and Triton).
May import: torch, transformers and the kernels' toolchains. Never Ray, and
nothing above it (serving, policies, small_model, cli, bench, testing).
"""
