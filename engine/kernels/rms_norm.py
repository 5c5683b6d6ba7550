"""RMSNorm (rms_norm.c), alone or after the residual add, for fp32 and bf16 on the CPU.

A decode step runs two norms and two residual adds per layer on a few rows of a few
hundred values; torch spends more on dispatching its ops than on the arithmetic (in
bf16 more still: each op converts). The kernel does each norm, and the add before
the block's second norm, in one call. Elsewhere (a GPU, other dtypes, no compiler)
the torch path runs: `rms_norm_reference`, which the tests hold the kernel to.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.kernels import native

SOURCE = Path(__file__).with_name("rms_norm.c")
COMPILE_FLAGS = ("-O3", "-march=native", "-fPIC", native.OPENMP)
"""No -ffast-math: the sum of squares keeps its written order."""
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES: dict[str, native.Signature] = {
    "rms_norm": ([_P, _P, _F, _I, _I, _P, _I], None),
    "add_rms_norm": ([_P, _P, _P, _F, _I, _I, _I], None),
    "rms_norm_bf16": ([_P, _P, _F, _I, _I, _P, _I], None),
    "add_rms_norm_bf16": ([_P, _P, _P, _F, _I, _I, _I], None),
}
_SUFFIX = {torch.float32: "", torch.bfloat16: "_bf16"}
"""The kernel's entry points by dtype."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dim, in x's dtype."""
    if not _takes(weight, x):
        return rms_norm_reference(x, weight, eps)
    x = x.contiguous()
    out = torch.empty_like(x)
    rows, dim = x.numel() // x.shape[-1], x.shape[-1]
    entry = getattr(_lib(), "rms_norm" + _SUFFIX[x.dtype])
    entry(x.data_ptr(), weight.data_ptr(), eps, rows, dim, out.data_ptr(), native.row_threads(rows))
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x): the skip connection and the next norm.

    Consumes both inputs: where the kernel runs it writes the sum into `residual` and the
    norm into `x` (a decode step's 2 norms a layer then allocate nothing), so a caller
    reads only what this returns."""
    if not (_takes(weight, x, residual) and x.is_contiguous() and residual.is_contiguous()):
        summed = residual + x
        return rms_norm_reference(summed, weight, eps), summed
    entry = getattr(_lib(), "add_rms_norm" + _SUFFIX[x.dtype])
    rows = x.numel() // x.shape[-1]
    entry(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), eps, rows, x.shape[-1],
          native.row_threads(rows))  # fmt: skip
    return x, residual


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch path: normalised in fp32 as the reference implementation does, then scaled."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
    return weight * normed


def _takes(weight: torch.Tensor, *inputs: torch.Tensor) -> bool:
    """The kernel applies: fp32 or bf16 throughout, on the CPU, no gradient to track."""
    return native.takes(_SUFFIX, weight, *inputs) and weight.is_contiguous() and _lib() is not None


@functools.cache
def _lib() -> ctypes.CDLL | None:
    return native.load(SOURCE, COMPILE_FLAGS, _SIGNATURES)
