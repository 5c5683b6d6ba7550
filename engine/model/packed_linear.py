"""Linear layers with their weights laid out once for oneDNN (the CPU fast path).

`F.linear` re-reads a weight in its plain layout on every call; oneDNN can
instead take a weight reordered ahead of time into its blocked layout. In bf16
that made the model's matmuls 1.2-1.5x faster at every batch size from 1 to
512 (bench/engine/bench_engine.py profiles a step), with bit-identical results. In
fp32 (on CPUs without fast bf16) it was as fast as MKL at one row and up to
1.8x faster at many (the 49k-wide output head most), and, unlike MKL, each
row's result does not depend on how many rows share the call: the batch
invariance engine.model.batch_invariance needs. It is a drop-in module swap,
as quantization is: the model never knows.
"""

from __future__ import annotations

import torch
from torch import nn

BATCH_HINT = 64
"""Rows the layout is tuned for; measured as good as exact hints from 1 to 512 rows."""


class PackedLinear(nn.Module):
    """An nn.Linear whose weight oneDNN has pre-reordered: same output, faster on CPU."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), BATCH_HINT)
        self.packed_weight: torch.Tensor
        self.register_buffer("packed_weight", packed)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T + b through oneDNN's packed kernel."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        """Shapes and the kernel, for printing the model."""
        dtype = str(self.packed_weight.dtype).removeprefix("torch.")
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn {dtype}"


def can_pack(device: str, dtype: torch.dtype) -> bool:
    """On a CPU with oneDNN: fp32, and bf16 where its build has the bf16 kernels."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (
        dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def pack_linears(model: nn.Module) -> None:
    """Swap every plain nn.Linear (quantized layers are not nn.Linear) in place."""
    linears = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    for name, linear in linears:
        model.set_submodule(name, PackedLinear(linear))
