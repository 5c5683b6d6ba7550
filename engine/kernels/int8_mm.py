"""Weight-only INT8 matmul: `y = x @ (q * scales[:, None]).T`, three ways.

One int8 value per weight and one scale per output channel (symmetric).
The scale is constant along K, so every implementation applies it to the
output instead of to the weight: the weight never exists in floating point.

- `int8_mm_reference`: plain torch, the definition every other path is tested against.
- `int8_mm_cpu`: torch's `aten._weight_int8pack_mm` for the few-token rows of a
  decode step (it reads int8 straight into the dot product: ~2x a bf16 matmul at
  batch 1 here), and a bf16/fp32 GEMM on the cast weight for many rows, where that
  op falls far behind a real GEMM (~7x slower at 64 rows).
- `int8_mm_triton`: a Triton kernel that converts tiles in registers (GPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

PACKED_OP_MAX_ROWS = 8
"""Rows up to which the packed CPU op beats cast-then-GEMM (measured at this model's shapes)."""


def int8_mm_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x: [M, K] float, qweight: [N, K] int8, scales: [N] -> [M, N] in x's dtype."""
    return (F.linear(x, qweight.to(x.dtype)) * scales).to(x.dtype)


def int8_mm_cpu(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fastest correct CPU path for the row count at hand.

    The packed op (torch 2.13) returns garbage in bf16 unless K % 16 == 0, and
    crashes the process on inputs or weights that are not 64-byte aligned
    (safetensors hands out 8-byte aligned views), so those take the reference.
    """
    packed_ok = x.shape[1] % 16 == 0 and _aligned(x) and _aligned(qweight)
    if x.shape[0] <= PACKED_OP_MAX_ROWS and packed_ok:
        return torch.ops.aten._weight_int8pack_mm(x, qweight, scales)
    return int8_mm_reference(x, qweight, scales)


def _aligned(tensor: torch.Tensor) -> bool:
    return tensor.data_ptr() % 64 == 0


def int8_mm_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Launch the fused kernel; works on CUDA and, with TRITON_INTERPRET=1, on CPU tensors."""
    x = x.contiguous()
    (m, k), n = x.shape, qweight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, 16), triton.cdiv(n, 64))
    _int8_mm_kernel[grid](x, qweight, scales, out, m, n, k, BLOCK_M=16, BLOCK_N=64, BLOCK_K=32)
    return out


@triton.jit
def _int8_mm_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    out_ptr,
    M,
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] output tile; int8 tiles are widened in registers.

    Everything is loaded and then cast to fp32 because the Triton interpreter
    computes garbage on bf16 tensors; on a GPU the cast is free next to the load.
    """
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        x_mask = (rows[:, None] < M) & (kk[None, :] < K)
        x = tl.load(x_ptr + rows[:, None] * K + kk[None, :], mask=x_mask, other=0.0)
        q_mask = (kk[:, None] < K) & (cols[None, :] < N)
        q = tl.load(q_ptr + cols[None, :] * K + kk[:, None], mask=q_mask, other=0)
        acc += tl.dot(x.to(tl.float32), q.to(tl.float32))  # [BLOCK_M, BLOCK_N]
    scales = tl.load(s_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    out = acc * scales[None, :]
    out_mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(
        out_ptr + rows[:, None] * N + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=out_mask
    )
