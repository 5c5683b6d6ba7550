"""The CPU paged-attention kernel (paged_attention.c), built on first use: short queries
always, prefill chunks too under batch invariance.

The C file is compiled on first use (engine/kernels/native.py, well under a
second). Where it cannot be built, `available()` is False and attention keeps
to its torch path, which is also the reference the tests compare this kernel
against.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from engine.kernels import native

SOURCE = Path(__file__).with_name("paged_attention.c")
COMPILE_FLAGS = ("-O3", "-march=native", "-fPIC", "-ffp-contract=off", native.OPENMP)
"""No -ffast-math: it would let the compiler reorder sums differently where rows share a
tile than where a row is alone, and batch invariance needs them the same. For the same
reason no contraction of a multiply and an add into one FMA (GCC's default for GNU C):
the compiler fused them in some unrolled copies of a tile's loops and not in others, so
a query's attention changed in the last bits with the number of queries beside it
(fp32, AVX2: position 29 computed with 26-28 against with 27-28). The queries are split
over torch's own OpenMP threads (native.OPENMP)."""
PARALLEL_MIN_QUERIES = 32
"""Fewer queries than this run on one thread: waking the others costs more than it saves."""
_ENTRY_POINTS = {
    (torch.float32, torch.float32): "paged_attention_f32",
    (torch.bfloat16, torch.bfloat16): "paged_attention_bf16",
    (torch.float32, torch.int8): "paged_attention_f32_i8",
    (torch.bfloat16, torch.int8): "paged_attention_bf16_i8",
    (torch.float32, torch.uint8): "paged_attention_f32_fp8",
    (torch.bfloat16, torch.uint8): "paged_attention_bf16_fp8",
}
"""By (query dtype, cache dtype): a cache in the query's dtype, or a quantized one
(engine.quant.kv: int8 codes, or fp8 e4m3 codes stored as uint8)."""
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES: list[type] = [_P, _P, _P, _P, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I]
_ARGTYPES += [ctypes.c_float]


def available(dtype: torch.dtype) -> bool:
    """The kernel is built and handles queries of this dtype, over a cache in the same
    dtype or a quantized one (EngineConfig.native_attention opts out)."""
    return (dtype, dtype) in _ENTRY_POINTS and _library() is not None


def paged_attention(
    q: torch.Tensor,  # [N, H, D] one row per query token
    k_cache: torch.Tensor,  # [num_slots, KVH, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64
    query_seq: torch.Tensor,  # [N] int64: the sequence each query belongs to
    visible: torch.Tensor,  # [N] int64: context positions each query sees
    block_size: int,
    thread_bounds: torch.Tensor | None = None,
) -> torch.Tensor:
    """[N, H, D] attention outputs, read straight from the paged cache.

    A quantized cache's rows are [D codes, bf16 scale] (k_cache [num_slots, KVH, D + 2]).
    The queries are split over torch's intra-op threads at `thread_bounds` (from
    `query_bounds`, where the caller has them already); each query is computed alone
    either way, so the split changes no bit."""
    lib = _library()
    assert lib is not None, "call available() first"
    q = q.contiguous()
    out = torch.empty_like(q)
    num_heads, head_dim = q.shape[1:]
    bounds = thread_bounds
    if bounds is None:
        bounds = query_bounds(visible, torch.get_num_threads())
    status = getattr(lib, _ENTRY_POINTS[q.dtype, k_cache.dtype])(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        block_tables.data_ptr(), block_tables.shape[1], query_seq.data_ptr(),
        visible.data_ptr(), bounds.data_ptr(), bounds.shape[0] - 1,
        num_heads, k_cache.shape[1], head_dim, block_size, head_dim**-0.5,
    )  # fmt: skip
    if status == -1:
        raise ValueError(f"paged attention: head_dim {head_dim} or GQA group too large")
    if status:
        raise MemoryError("paged attention: no memory for a thread's tile")
    return out


def query_bounds(visible: torch.Tensor, num_threads: int) -> torch.Tensor:
    """Edges [parts + 1] of contiguous query ranges, one per thread, of about equal work
    (the context each query reads); one range when there are too few queries to be worth
    a thread."""
    num_queries = visible.shape[0]
    parts = max(1, num_threads) if num_queries >= PARALLEL_MIN_QUERIES else 1
    if parts == 1:
        return torch.tensor([0, num_queries])
    work = visible.cumsum(0)
    shares = work[-1] * torch.arange(1, parts) / parts
    inner = torch.searchsorted(work, shares)
    return torch.cat([torch.tensor([0]), inner, torch.tensor([num_queries])]).unique_consecutive()


@functools.cache
def _library() -> ctypes.CDLL | None:
    signatures: dict[str, native.Signature] = {
        name: (_ARGTYPES, ctypes.c_int) for name in _ENTRY_POINTS.values()
    }
    return native.load(SOURCE, COMPILE_FLAGS, signatures)
