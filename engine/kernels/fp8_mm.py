"""FP8 (e4m3) weights on the CPU (fp8_mm.c): one byte a weight read, decoded in registers.

This CPU has no FP8 matmul. Expanded to the model's dtype at load, an FP8 checkpoint reads
two bytes a weight and decodes no faster than bf16; a decode step's matmuls are bound by
those reads. The kernel keeps the codes and the checkpoint's scales (per tensor, output
channel or block, all as a scale per output row and group of inputs) and multiplies in
fp32 (at many rows, where multiply-adds bound a matmul, slower than oneDNN's bf16: see
the C file). `fp8_mm_reference` is the same maths in float64 torch: the tests hold the
kernel to it, and to batch invariance. Where the kernel cannot be built (no compiler, no
AVX2 / F16C / FMA), `available()` is False and FP8 checkpoints load dense.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.kernels import native

SOURCE = Path(__file__).with_name("fp8_mm.c")
COMPILE_FLAGS = ("-O3", "-march=native", "-fPIC", "-ffp-contract=off", native.OPENMP)
"""No -ffast-math and no contraction the code does not ask for: every output sums in its
written order, the same for a row computed alone or in a batch. Output blocks are split
over torch's own OpenMP threads (native.OPENMP)."""
AVX2_FLAGS = ("-mno-avx512f",)
"""Added to the flags, they build the 256-bit path on an AVX-512 CPU (the tests run both)."""
PARTIALS = 4
"""Inputs a partial sum steps over (fp8_mm.c): a group holds a multiple of this many."""
DECODED_SCALE = 2.0**8
"""A code decodes to its e4m3 value times 2^-8 (fp8_mm.c); the scales carry the 2^8."""
PARALLEL_MIN_ROWS = 512
"""Fewer output rows than this run on one thread: waking the others costs more."""
CodesAndScales = tuple[torch.Tensor, torch.Tensor]
_P = ctypes.c_void_p
_I = ctypes.c_int64
_SIGNATURES: dict[str, native.Signature] = {
    "fp8_matmul": ([_P] * 4 + [_I] * 5, None),
    "fp8_rows_per_block": ([], ctypes.c_int),
}


@dataclass(frozen=True)
class Fp8Layout:
    """Which build of the kernel: the CPU's widest vectors, or the 256-bit path."""

    extra_flags: tuple[str, ...] = ()

    def available(self) -> bool:
        """The kernel is built for this CPU."""
        return _library(self.extra_flags) is not None

    def rows_per_block(self) -> int:
        """Output rows per weight block: 16 in 512-bit registers, else 8."""
        lib = _library(self.extra_flags)
        assert lib is not None, "call available() first"
        return int(lib.fp8_rows_per_block())

    def supports(self, out_features: int, in_features: int, group_size: int) -> bool:
        """Shapes the kernel's blocking takes: whole blocks of rows, groups of 4j inputs."""
        return (
            out_features % self.rows_per_block() == 0
            and group_size % PARTIALS == 0
            and in_features % group_size == 0
        )

    def repack(self, codes: torch.Tensor, scales: torch.Tensor) -> CodesAndScales:
        """e4m3 codes [N, K] and scales [N, G] -> the kernel's codes [N / R, K, R] (int8
        bytes) and scales [N / R, G, R] (fp32, times DECODED_SCALE)."""
        (n, k), rows = codes.shape, self.rows_per_block()
        assert self.supports(n, k, k // scales.shape[1]), "check supports() first"
        blocked = codes.view(torch.int8).view(n // rows, rows, k).transpose(1, 2)
        scaled = (scales.float() * DECODED_SCALE).view(n // rows, rows, -1).transpose(1, 2)
        return blocked.contiguous(), scaled.contiguous()

    def unpack(self, codes: torch.Tensor, scales: torch.Tensor) -> CodesAndScales:
        """`repack`'s inverse: e4m3 codes [N, K] and scales [N, G]."""
        blocks, k, rows = codes.shape
        plain = codes.transpose(1, 2).reshape(blocks * rows, k).view(torch.float8_e4m3fn)
        return plain, scales.transpose(1, 2).reshape(blocks * rows, -1) / DECODED_SCALE

    def matmul(self, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """x [M, K] @ W^T -> [M, N] in x's dtype, for `repack`'s codes and scales. Output
        blocks are split over torch's intra-op threads; every output is computed the same
        way whatever the split."""
        lib = _library(self.extra_flags)
        assert lib is not None, "call available() first"
        x32 = x.contiguous().float()
        (m, k), (blocks, _, rows), groups = x32.shape, codes.shape, scales.shape[1]
        n = blocks * rows
        out = torch.empty((m, n), dtype=torch.float32)
        threads = torch.get_num_threads() if n >= PARALLEL_MIN_ROWS else 1
        lib.fp8_matmul(x32.data_ptr(), codes.data_ptr(), scales.data_ptr(), out.data_ptr(),
                       m, n, k, k // groups, threads)  # fmt: skip
        return out.to(x.dtype)


NATIVE = Fp8Layout()
"""The build every engine uses: the widest vectors this CPU has."""


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The [N, K] weight that e4m3 codes [N, K] and scales per row and group [N, G] mean."""
    group = codes.shape[1] // scales.shape[1]
    return codes.to(dtype) * scales.to(dtype).repeat_interleave(group, dim=1)


def fp8_mm_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in float64: x [M, K] times e4m3 codes [N, K] scaled per row
    and group of inputs by scales [N, G]."""
    return (x.double() @ dequantize(codes, scales, torch.float64).T).to(x.dtype)


@functools.cache
def _library(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    return native.load(SOURCE, COMPILE_FLAGS + extra_flags, _SIGNATURES)
