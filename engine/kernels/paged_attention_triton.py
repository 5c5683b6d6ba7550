"""Paged attention for short queries on a GPU (Triton): decodes and the k + 1 rows of a
speculative verification, read from the paged cache in place.

The CUDA twin of the C kernel (paged_attention.c), with its arguments: one row per query
token, the sequence it belongs to and how many context positions it sees, so a
verification's rows are queries like any other and none is padded. One program computes
one (query, head): it walks the sequence's blocks in order with an online softmax (the
running maximum and sum rescaled as each block arrives), in fp32, and writes the output
in the query's dtype. A cache in the model's dtype only; a quantized one keeps to the
torch path on a GPU (engine.model.model_runner decides). Tested on CPU tensors under
Triton's interpreter against the torch path, on a GPU where one is lent.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Query and cache dtypes the kernel takes (the same for both)."""


def available(dtype: torch.dtype) -> bool:
    """The kernel handles queries and a cache of this dtype."""
    return dtype in DTYPES


def paged_attention_triton(
    q: torch.Tensor,  # [N, H, D] one row per query token
    k_cache: torch.Tensor,  # [num_slots, KVH, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64
    query_seq: torch.Tensor,  # [N] int64: the sequence each query belongs to
    visible: torch.Tensor,  # [N] int64: context positions each query sees (>= 1)
    block_size: int,
) -> torch.Tensor:
    """[N, H, D] attention outputs; every tensor on one device (CUDA, or the CPU under
    TRITON_INTERPRET=1)."""
    if block_size & (block_size - 1):
        raise ValueError(
            f"paged attention on a GPU needs a power-of-two block_size, got {block_size}"
        )
    q = q.contiguous()
    num_queries, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    if num_queries:
        _paged_attention_kernel[(num_queries, num_heads)](
            q, k_cache, v_cache, out, block_tables, query_seq, visible,
            block_tables.shape[1], num_heads, k_cache.shape[1], head_dim**-0.5,
            HEAD_DIM=head_dim, HEAD_DIM_POW2=triton.next_power_of_2(head_dim),
            BLOCK_SIZE=block_size,
        )  # fmt: skip
    return out


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, query_seq_ptr, visible_ptr,
    max_blocks, num_heads, num_kv_heads, scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_POW2: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    query = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // (num_heads // num_kv_heads)
    seq = tl.load(query_seq_ptr + query)
    visible = tl.load(visible_ptr + query)
    dims = tl.arange(0, HEAD_DIM_POW2)
    in_head = dims < HEAD_DIM
    row = (query * num_heads + head) * HEAD_DIM
    q = tl.load(q_ptr + row + dims, mask=in_head, other=0.0).to(tl.float32) * scale
    offsets = tl.arange(0, BLOCK_SIZE)
    running_max = tl.full((), float("-inf"), tl.float32)
    running_sum = tl.full((), 0.0, tl.float32)
    acc = tl.full((HEAD_DIM_POW2,), 0.0, tl.float32)
    for block in range(0, (visible + BLOCK_SIZE - 1) // BLOCK_SIZE):
        block_id = tl.load(tables_ptr + seq * max_blocks + block)
        seen = block * BLOCK_SIZE + offsets < visible
        slots = block_id * BLOCK_SIZE + offsets
        cells = (slots[:, None] * num_kv_heads + kv_head) * HEAD_DIM + dims[None, :]
        readable = seen[:, None] & in_head[None, :]
        k = tl.load(k_ptr + cells, mask=readable, other=0.0).to(tl.float32)
        scores = tl.where(seen, tl.sum(k * q[None, :], axis=1), float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=0))
        weights = tl.exp(scores - new_max)
        rescale = tl.exp(running_max - new_max)
        v = tl.load(v_ptr + cells, mask=readable, other=0.0).to(tl.float32)
        acc = acc * rescale + tl.sum(weights[:, None] * v, axis=0)
        running_sum = running_sum * rescale + tl.sum(weights, axis=0)
        running_max = new_max
    tl.store(out_ptr + row + dims, (acc / running_sum).to(out_ptr.dtype.element_ty), mask=in_head)
