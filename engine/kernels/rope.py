"""Rotary embeddings (rope.c) in place on the fused QKV projection, for fp32 and bf16 on
the CPU.

torch spends five ops per tensor per layer on the rotation (negate, concatenate, two
products, a sum), each a dispatch and a pass over memory; at decode sizes that costs
more than the arithmetic. The kernel rotates q's and k's heads in one pass over each
row, rounding as torch does, so its result is torch's to the bit. Elsewhere (a GPU,
other dtypes, autograd, no compiler) `rotate_in_place` declines and the caller keeps
to torch (engine.model.llama.rotate).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from engine.kernels import native

SOURCE = Path(__file__).with_name("rope.c")
COMPILE_FLAGS = ("-O3", "-march=native", "-fPIC", "-ffp-contract=off")
"""No fused multiply-add: torch rounds each product before the sum."""
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ENTRY_POINTS = {torch.float32: "rope_f32", torch.bfloat16: "rope_bf16"}
_SIGNATURES: dict[str, native.Signature] = {
    name: ([_P, _P, _P, _I, _I, _I, _I], ctypes.c_int) for name in _ENTRY_POINTS.values()
}


def rotate_in_place(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, head_dim: int
) -> bool:
    """Rotate the first `num_heads` heads of every row of `x` [T, row width] in place by
    cos, sin [T, ..., head_dim]; False (and `x` untouched) where the kernel does not apply."""
    if not _takes(x, cos, sin):
        return False
    cos, sin = cos.contiguous(), sin.contiguous()
    entry = getattr(_lib(), _ENTRY_POINTS[x.dtype])
    status = entry(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), x.shape[0], x.stride(0),
                   num_heads, head_dim)  # fmt: skip
    if status:
        raise ValueError(f"rope: head_dim {head_dim} is odd or too large")
    return True


def _takes(x: torch.Tensor, *tables: torch.Tensor) -> bool:
    """One dtype the kernel has, on the CPU, rows laid out densely, no gradient to track."""
    dense_rows = x.dim() == 2 and x.stride(1) == 1
    return native.takes(_ENTRY_POINTS, x, *tables) and dense_rows and _lib() is not None


@functools.cache
def _lib() -> ctypes.CDLL | None:
    return native.load(SOURCE, COMPILE_FLAGS, _SIGNATURES)
