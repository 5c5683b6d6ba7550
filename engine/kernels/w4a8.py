"""W4A8 on the CPU (w4a8.c): INT4 weights times activations quantized to int8 on the fly,
and W8A8, the same for the INT8 layers of a mixed-precision config.

The engine's INT4 layers keep their codes in the tile64 layout (engine/kernels/int4_mm.py)
that torch's weight-only op and the Triton kernel read. This kernel wants each block
of R output rows as chunks of R rows x 8 inputs (see the C file; R is 16 where the
build has AVX-512 VNNI, else 8: `rows_per_block`), so a layer is repacked once, at
its first CPU call (`repack`), beside its tile64 codes.

Activations are quantized per row and per weight group (symmetric, scale max|x| /
127), so an outlier only coarsens its own group. `w4a8_mm_reference` is the same
maths in float64 torch: the tests hold the kernel to it, and to batch invariance.
Where the kernel cannot be built (no compiler, no AVX2), `available()` is False and
INT4 layers keep to the weight-only path. W8A8 reads INT8 codes as chunks of R rows x
4 inputs (`repack_int8`) with the INT8 layer's per-row scales.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.kernels import native
from engine.kernels.int4_mm import int4_dequantize, unpack_int4

SOURCE = Path(__file__).with_name("w4a8.c")
COMPILE_FLAGS = ("-O3", "-march=native", "-fPIC", native.OPENMP)
"""No -ffast-math: every float step stays in its written order, the same for a row
computed alone or in a batch. Output blocks are split over torch's own OpenMP
threads (native.OPENMP). -march=native turns on the VNNI dot products where the
CPU has them (see the C file)."""
WITHOUT_VNNI_FLAGS = ("-mno-avx512vnni", "-mno-avxvnni")
"""Added to the flags, they build the AVX2 path on a VNNI CPU (the tests compare both)."""
INPUTS_PER_CHUNK = 8
PARALLEL_MIN_ROWS = 512
"""Fewer output rows than this run on one thread: waking the others costs more."""
_P = ctypes.c_void_p
_I = ctypes.c_int64
_SIGNATURES: dict[str, native.Signature] = {
    "w4a8_quantize": ([_P, _I, _I, _I, _P, _P, _P], None),
    "w4a8_matmul": ([_P] * 7 + [_I] * 5, None),
    "w8a8_matmul": ([_P] * 6 + [_I] * 5, ctypes.c_int),
    "w4a8_uses_vnni": ([], ctypes.c_int),
    "w4a8_rows_per_block": ([], ctypes.c_int),
}
INT8_INPUTS_PER_CHUNK = 4


@dataclass(frozen=True)
class A8Weight:
    """A quantized weight in the kernels' layout: INT4 (W4A8) when it has zeros, else INT8
    (W8A8)."""

    codes: torch.Tensor
    """INT4: uint8 [N / R, K / 8, 4 R], per R-row block chunks of R rows x 8 inputs, two
    codes a byte. INT8: int8 [N / R, K / 4, 4 R], chunks of R rows x 4 inputs. R is the
    building library's `rows_per_block()`."""
    scales: torch.Tensor
    """INT4: fp32 [K / group, N], s, each group's step. INT8: fp32 [N], each row's step."""
    group_size: int
    """Inputs per activation scale (INT4: the weight's own groups)."""
    zeros: torch.Tensor | None = None
    """INT4: fp32 [K / group, N], z, the value of code 8. INT8: None."""
    offsets: torch.Tensor | None = None
    """INT8: int32 [K / group, N], 128 times each group's weight sum: what the VNNI path's
    activations, shifted by +128 to unsigned, add to each dot product. INT4: None."""

    @property
    def out_features(self) -> int:
        """N."""
        return self.scales.shape[-1]


def available() -> bool:
    """The kernel is built for this CPU."""
    return _library() is not None


def uses_vnni() -> bool:
    """The kernel's dot products run on VNNI here (else on AVX2's multiply-adds)."""
    lib = _library()
    return lib is not None and bool(lib.w4a8_uses_vnni())


def rows_per_block() -> int:
    """Output rows per weight block in the built kernel's layout: 16 with AVX-512 VNNI, else 8."""
    lib = _library()
    assert lib is not None, "call available() first"
    return int(lib.w4a8_rows_per_block())


def supports(out_features: int, in_features: int, group_size: int) -> bool:
    """Shapes the kernel's blocking takes (every Llama projection with a group of 32-128)."""
    return (
        out_features % rows_per_block() == 0
        and group_size % INPUTS_PER_CHUNK == 0
        and in_features % group_size == 0
    )


def repack(packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> A8Weight:
    """tile64 codes and [G, N, 2] (scale, zero) -> the kernel's layout."""
    codes = unpack_int4(packed)  # [N, K]
    n, k = codes.shape
    rows = _block_rows("W4A8", n, k, group_size)
    chunks = codes.view(n // rows, rows, k // INPUTS_PER_CHUNK, 2, 4)
    chunks = chunks.permute(0, 2, 1, 3, 4)  # [block, chunk, row, half, input]
    low, high = chunks[..., 0, :], chunks[..., 1, :]
    chunk_bytes = (low | (high << 4)).reshape(n // rows, k // INPUTS_PER_CHUNK, 4 * rows)
    scales, zeros = scales_and_zeros.float().unbind(-1)
    return A8Weight(chunk_bytes.contiguous(), scales.contiguous(), group_size, zeros.contiguous())


def repack_int8(qweight: torch.Tensor, scales: torch.Tensor, group_size: int) -> A8Weight:
    """int8 [N, K] codes and per-row scales [N] -> the kernel's layout, activations quantized
    per `group_size` inputs."""
    n, k = qweight.shape
    rows = _block_rows("W8A8", n, k, group_size)
    chunks = qweight.view(n // rows, rows, k // INT8_INPUTS_PER_CHUNK, 4)
    chunk_bytes = chunks.permute(0, 2, 1, 3).reshape(n // rows, -1, 4 * rows)
    group_sums = qweight.view(n, k // group_size, group_size).sum(-1, dtype=torch.int32)
    offsets = (group_sums * 128).T.contiguous()
    return A8Weight(
        chunk_bytes.contiguous(), scales.float().contiguous(), group_size, None, offsets
    )


def _block_rows(kind: str, n: int, k: int, group_size: int) -> int:
    """The built kernel's rows per block, once the [n, k] weight is known to fit its blocking."""
    if not supports(n, k, group_size):
        raise ValueError(
            f"{kind} takes N % {rows_per_block()} == 0 and groups of 8j dividing K, "
            f"got {n}x{k}, group {group_size}"
        )
    return rows_per_block()


def a8_mm(x: torch.Tensor, weight: A8Weight) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype, x quantized to int8 on the way in. Output
    blocks are split over torch's intra-op threads; every output is computed the same
    way whatever the split."""
    lib = _library()
    assert lib is not None, "call available() first"
    xq, scale, code_sum = _quantize(lib, x, weight.group_size)
    (m, k), n, zeros = xq.shape, weight.out_features, weight.zeros
    out = torch.empty((m, n), dtype=torch.float32)
    threads = torch.get_num_threads() if n >= PARALLEL_MIN_ROWS else 1
    args = (out.data_ptr(), m, n, k, weight.group_size, threads)
    w, s = weight.codes.data_ptr(), weight.scales.data_ptr()
    if zeros is None:
        assert weight.offsets is not None
        status = lib.w8a8_matmul(xq.data_ptr(), scale.data_ptr(), w, weight.offsets.data_ptr(),
                                 s, *args)  # fmt: skip
        if status != 0:
            raise MemoryError("W8A8: no memory for the shifted activations")
    else:
        lib.w4a8_matmul(xq.data_ptr(), scale.data_ptr(), code_sum.data_ptr(), w, s,
                        zeros.data_ptr(), *args)  # fmt: skip
    return out.to(x.dtype)


def _quantize(
    lib: ctypes.CDLL, x: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x's int8 codes [M, K], and per (row, group) their scale and code sum."""
    x32 = x.contiguous().float()
    m, k = x32.shape
    xq = torch.empty((m, k), dtype=torch.int8)
    scale = torch.empty((m, k // group), dtype=torch.float32)
    code_sum = torch.empty((m, k // group), dtype=torch.int32)
    lib.w4a8_quantize(x32.data_ptr(), m, k, group, xq.data_ptr(), scale.data_ptr(),
                      code_sum.data_ptr())  # fmt: skip
    return xq, scale, code_sum


def quantize_activations(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation codes [M, K] (int8 values) and scales [M, K / group]."""
    groups = x.float().view(x.shape[0], -1, group_size)
    amax = groups.abs().amax(-1)
    # Tensor / tensor: torch computes scalar / tensor as a reciprocal times the scalar,
    # which can be an ulp off the kernel's division and round a code the other way.
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    codes = torch.round(groups * inv[..., None]).clamp(-127, 127)
    return codes.view(x.shape), amax / 127.0


def w4a8_mm_reference(
    x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """What the kernel computes, in float64: quantized activations times the INT4 weight."""
    codes, scales = quantize_activations(x, group_size)
    activations = (codes.view(x.shape[0], -1, group_size) * scales[..., None]).view(x.shape)
    weight = int4_dequantize(packed, scales_and_zeros.double(), group_size, torch.float64)
    return (activations.double() @ weight.T).to(x.dtype)


def w8a8_mm_reference(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """What the W8A8 kernel computes, in float64."""
    codes, activation_scales = quantize_activations(x, group_size)
    groups = codes.view(x.shape[0], -1, group_size) * activation_scales[..., None]
    weight = qweight.double() * scales.double()[:, None]
    return (groups.view(x.shape).double() @ weight.T).to(x.dtype)


@functools.cache
def _library(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    return native.load(SOURCE, COMPILE_FLAGS + extra_flags, _SIGNATURES)
