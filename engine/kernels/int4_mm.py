"""Weight-only INT4 matmul with group-wise scales and zero points, three ways.

Numerics: each run of `group_size` weights along K shares a scale `s` and a
zero `z`, and a 4-bit code `q` in [0, 15] stands for `(q - 8) * s + z`. That is
torch's own convention for `aten._weight_int4pack_mm_for_cpu`, so the CPU fast
path takes our tensors as they are.

Layout ("tile64", also torch's on AVX2/AVX-512 CPUs): `packed` is uint8
[N, K / 2] whose memory reads as [N / 64, K, 32]: byte (b, k, j) holds output
row 64b + j in its low nibble and row 64b + 32 + j in its high nibble. One
layout serves the checkpoint, the CPU op and the Triton kernel, so loading is
a read with no repacking. It needs N % 64 == 0, true of every Llama
projection; other shapes stay unquantized (see engine/quant.py).
`scales_and_zeros` is [K / group_size, N, 2] (scale, zero), the CPU op's layout.

- `int4_mm_reference`: de-quantize the weight tile by tile, then a batched GEMM.
- `int4_mm_cpu`: the packed op for few rows (decode), the reference for many.
- `int4_mm_triton`: a Triton kernel that unpacks and de-quantizes tiles in registers.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

TILE_N = 64
PACKED_OP_MAX_ROWS = 32
"""Rows up to which the packed CPU op beats de-quantize-then-GEMM (measured here)."""


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes: [N, K] integers in [0, 15] -> uint8 [N, K / 2] in the tile64 layout."""
    n, k = codes.shape
    assert n % TILE_N == 0 and k % 2 == 0, f"int4 packing needs N % 64 == 0 and even K, got {n}x{k}"
    halves = codes.to(torch.uint8).view(n // TILE_N, 2, TILE_N // 2, k)  # [B, 2, 32, K]
    tiles = halves.transpose(2, 3)  # [B, 2, K, 32]
    return (tiles[:, 0] | (tiles[:, 1] << 4)).reshape(n, k // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4`: uint8 [N, K / 2] -> uint8 codes [N, K]."""
    n, k = packed.shape[0], packed.shape[1] * 2
    tiles = packed.view(n // TILE_N, k, TILE_N // 2)  # [B, K, 32]
    halves = torch.stack([tiles & 0xF, tiles >> 4], dim=1)  # [B, 2, K, 32]
    return halves.transpose(2, 3).reshape(n, k)


def int4_dequantize(
    packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """The dense [N, K] weight the codes stand for."""
    tiles = _dequantize_tiles(packed, scales_and_zeros, group_size, dtype)  # [B, K, 64]
    return tiles.transpose(1, 2).reshape(packed.shape[0], -1)


def int4_mm_reference(
    x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """x: [M, K] -> [M, N] in x's dtype.

    Multiplies by the de-quantized tiles as they come ([B, K, 64], a batched
    matmul) rather than building the dense [N, K] weight: on a CPU every extra
    elementwise pass over the weight costs as much as the GEMM itself.
    """
    tiles = _dequantize_tiles(packed, scales_and_zeros, group_size, x.dtype)
    out = torch.matmul(x, tiles)  # [B, M, 64]
    return out.transpose(0, 1).reshape(x.shape[0], packed.shape[0])


def _dequantize_tiles(
    packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """W.T one 64-column tile at a time, [N / 64, K, 64]: the layout's natural order."""
    n, k = packed.shape[0], packed.shape[1] * 2
    num_tiles, num_groups = n // TILE_N, k // group_size
    tiles = packed.view(num_tiles, k, TILE_N // 2)  # [B, K, 32]
    codes = torch.stack([tiles & 0xF, tiles >> 4], dim=2)  # [B, K, 2, 32] == [B, K, 64]
    codes = codes.view(num_tiles, num_groups, group_size, TILE_N)
    per_tile = scales_and_zeros.to(dtype).view(num_groups, num_tiles, 1, TILE_N, 2)
    scales, zeros = per_tile.permute(4, 1, 0, 2, 3).contiguous()  # 2 x [B, G, 1, 64]
    weights = torch.addcmul(zeros - 8 * scales, codes.to(dtype), scales)
    return weights.view(num_tiles, k, TILE_N)


def int4_mm_cpu(
    x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """The fastest correct CPU path for the row count at hand."""
    if x.shape[0] <= PACKED_OP_MAX_ROWS and cpu_op_uses_tile64():
        x = x.contiguous()  # the op refuses a view (a bf16 head's last rows, say)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)
    return int4_mm_reference(x, packed, scales_and_zeros, group_size)


@functools.cache
def cpu_op_uses_tile64() -> bool:
    """Whether this CPU's int4 op reads our layout (it packs differently without AVX2)."""
    codes = torch.arange(TILE_N * 32, dtype=torch.int32).view(TILE_N, 32) % 16
    theirs = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
    return torch.equal(theirs, pack_int4(codes))


def int4_mm_triton(
    x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Launch the fused kernel; works on CUDA and, with TRITON_INTERPRET=1, on CPU tensors."""
    x = x.contiguous()
    (m, k), n = x.shape, packed.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, 16), n // TILE_N)
    _int4_mm_kernel[grid](
        x,
        packed,
        scales_and_zeros,
        out,
        m,
        n,
        k,
        GROUP_SIZE=group_size,
        BLOCK_M=16,
        BLOCK_K=32,
    )
    return out


@triton.jit
def _int4_mm_kernel(
    x_ptr,
    q_ptr,
    sz_ptr,
    out_ptr,
    M,
    N,
    K,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One [BLOCK_M, 64] output tile: the low nibbles feed columns 0-31, the high 32-63.

    BLOCK_K divides every group size, so each K step reads one (scale, zero)
    per column. Loads are cast to fp32 because the interpreter mishandles bf16.
    """
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    tile = tl.program_id(1)
    j = tl.arange(0, 32)
    ks = tl.arange(0, BLOCK_K)
    cols_lo = tile * 64 + j
    cols_hi = cols_lo + 32
    acc_lo = tl.full((BLOCK_M, 32), 0.0, dtype=tl.float32)
    acc_hi = tl.full((BLOCK_M, 32), 0.0, dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        x = tl.load(x_ptr + rows[:, None] * K + kk[None, :], mask=rows[:, None] < M, other=0.0)
        x = x.to(tl.float32)  # [BLOCK_M, BLOCK_K]
        b = tl.load(q_ptr + tile * K * 32 + kk[:, None] * 32 + j[None, :])
        b = b.to(tl.int32)  # [BLOCK_K, 32], two codes a byte
        sz = sz_ptr + (k0 // GROUP_SIZE) * N * 2  # this K step's group: (scale, zero) pairs
        acc_lo += tl.dot(x, _dequantize(b & 0xF, sz, cols_lo))
        acc_hi += tl.dot(x, _dequantize(b >> 4, sz, cols_hi))
    out_rows = out_ptr + rows[:, None] * N
    mask = rows[:, None] < M
    tl.store(out_rows + cols_lo[None, :], acc_lo.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_rows + cols_hi[None, :], acc_hi.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequantize(codes, sz, cols):
    """fp32 weights [BLOCK_K, 32] of INT4 `codes` in columns `cols`: (code - 8) * scale +
    zero, with each column's (scale, zero) pair read from its group's row `sz`."""
    scale = tl.load(sz + cols * 2).to(tl.float32)
    zero = tl.load(sz + cols * 2 + 1).to(tl.float32)
    return (codes.to(tl.float32) - 8.0) * scale[None, :] + zero[None, :]
