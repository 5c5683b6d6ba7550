"""bf16 linear layers with their weights laid out once for oneDNN (the CPU fast path).

`F.linear` re-reads a bf16 weight in its plain layout on every call; oneDNN can
instead take a weight reordered ahead of time into its blocked layout. On this
project's CPUs that made the model's matmuls 1.2-1.5x faster at every batch
size from 1 to 512 (load/bench_engine.py profiles a step), with bit-identical
results. It is a drop-in module swap, as quantization is: the model never
knows.
"""

from __future__ import annotations

import torch
from torch import nn

BATCH_HINT = 64
"""Rows the layout is tuned for; measured as good as exact hints from 1 to 512 rows."""


class PackedLinear(nn.Module):
    """A bf16 nn.Linear whose weight oneDNN has pre-reordered: same output, faster on CPU."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), BATCH_HINT)
        self.packed_weight: torch.Tensor
        self.register_buffer("packed_weight", packed)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T + b through oneDNN's packed bf16 kernel."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        """Shapes and the kernel, for printing the model."""
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn bf16"


def can_pack(device: str, dtype: torch.dtype) -> bool:
    """Only bf16 on a CPU whose oneDNN build has the bf16 kernels."""
    return (
        torch.device(device).type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def pack_linears(model: nn.Module) -> None:
    """Swap every plain bf16 nn.Linear (quantized layers are not nn.Linear) in place."""
    linears = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    for name, linear in linears:
        model.set_submodule(name, PackedLinear(linear))
