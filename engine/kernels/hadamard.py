"""The normalized Hadamard transform of rows (hadamard.c) for fp32 and bf16 on the CPU: the
rotation of an int8 KV cache (engine/quant/kv.py `rotate`, which keeps the torch path as
the reference and for everything else: a GPU, other dtypes, no compiler)."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from engine.kernels import native

SOURCE = Path(__file__).with_name("hadamard.c")
COMPILE_FLAGS = ("-O3", "-march=native", "-fPIC")
"""No -ffast-math: the butterflies keep the reference's operations."""
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES: dict[str, native.Signature] = {
    "hadamard": ([_P, _I, _I, _I, _F, _P], None),
    "hadamard_bf16": ([_P, _I, _I, _I, _F, _P], None),
}
_ENTRY = {torch.float32: "hadamard", torch.bfloat16: "hadamard_bf16"}


def takes(x: torch.Tensor) -> bool:
    """The kernel applies to `x`: fp32 or bf16 on the CPU, no gradient, and it builds here."""
    return native.takes(_ENTRY, x) and _lib() is not None


def hadamard(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [..., D] with each block of `block` values of a row times the Hadamard matrix
    scaled by block^-1/2 (`takes(x)` must hold)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dim = x.shape[-1]
    entry = getattr(_lib(), _ENTRY[x.dtype])
    entry(x.data_ptr(), x.numel() // dim, dim, block, block**-0.5, out.data_ptr())
    return out


@functools.cache
def _lib() -> ctypes.CDLL | None:
    return native.load(SOURCE, COMPILE_FLAGS, _SIGNATURES)
