"""The in-place CPU paged-attention kernel against the padded torch path it replaces."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.kernels import paged_attention as kernels
from engine.model import attention
from engine.model.attention import AttentionMetadata, KernelGroup
from testing.engine_helpers import on_one_and_two_threads, scattered_block_tables

BLOCK = 4
HEADS, KV_HEADS, HEAD_DIM = 6, 2, 16


def _case(q_lens: list[int], kv_lens: list[int], dtype: torch.dtype, seed: int = 0):
    """Random cache contents, block tables scattered over a pool, and this step's q/k/v."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks, tables = scattered_block_tables(kv_lens, BLOCK, gen)
    k_cache = torch.randn(num_blocks * BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks * BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    num_tokens = sum(q_lens)
    q = torch.randn(num_tokens, HEADS, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    return q, k, v, k_cache, v_cache, tables


def _run(case, q_lens, kv_lens, dtype, use_kernel: bool, monkeypatch) -> torch.Tensor:
    q, k, v, k_cache, v_cache, tables = (t.clone() if torch.is_tensor(t) else t for t in case)
    monkeypatch.setattr(kernels, "available", lambda _dtype: use_kernel)
    meta = AttentionMetadata.build(q_lens, kv_lens, tables, BLOCK, "cpu", dtype)
    assert any(isinstance(g, KernelGroup) for g in meta.groups) == use_kernel
    return attention.paged_attention(q, k, v, k_cache, v_cache, meta)


pytestmark = pytest.mark.skipif(
    not kernels.available(torch.float32), reason="no C compiler to build the kernel"
)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(
    ("q_lens", "kv_lens"),
    [
        ([1], [1]),  # the first decode token of a one-token prompt
        ([1, 1, 1], [5, 17, 33]),  # decodes of different lengths, blocks scattered
        ([3, 1, 5], [9, 40, 12]),  # draft verification: several queries per sequence
        ([1, 20, 2], [8, 20, 30]),  # a prefill chunk stays on the padded path beside them
    ],
)
def test_kernel_matches_padded_torch_path(q_lens, kv_lens, dtype, tolerance, monkeypatch):
    case = _case(q_lens, kv_lens, dtype)
    expected = _run(case, q_lens, kv_lens, dtype, use_kernel=False, monkeypatch=monkeypatch)
    actual = _run(case, q_lens, kv_lens, dtype, use_kernel=True, monkeypatch=monkeypatch)
    torch.testing.assert_close(actual.float(), expected.float(), atol=tolerance, rtol=tolerance)


def test_queries_of_one_sequence_see_causal_prefixes():
    group = attention._kernel_group(
        [attention._Seq(3, 10, [0, 1, 2], 0)], BLOCK, whole_batch=True, device="cpu"
    )
    assert group.visible.tolist() == [8, 9, 10]
    assert group.query_seq.tolist() == [0, 0, 0]


def test_loading_the_kernel_keeps_subnormal_floats():
    """A library linked with -ffast-math would switch the process to flush-to-zero."""
    assert kernels.available(torch.float32)
    assert (torch.tensor([1e-40]) * 1.0).item() != 0.0  # a float32 subnormal


KERNEL_RUNTIMES = """
import torch
from pathlib import Path
from engine.kernels import paged_attention as kernels
assert kernels.available(torch.float32)
maps = Path("/proc/self/maps").read_text().splitlines()
print(sorted({line.split()[-1] for line in maps if "libgomp" in line}))
"""
"""In an interpreter of its own, as an engine process: what the kernel loads, not what other
tests imported here (faiss, for the ingress's semantic cache, brings its own libgomp)."""


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc")
def test_the_kernel_threads_are_torchs_own_openmp_threads():
    """Its libgomp.so.1 resolves to the runtime torch loaded: no second thread pool spinning
    beside torch's on the same cores."""
    run = subprocess.run(
        [sys.executable, "-c", KERNEL_RUNTIMES], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr
    runtimes = ast.literal_eval(run.stdout.strip().splitlines()[-1])
    assert len(runtimes) == 1, runtimes


def test_prefill_chunks_in_the_kernel_match_sdpa_and_split_over_threads_bit_for_bit():
    q_lens, kv_lens = [40, 1, 70], [40, 9, 90]  # a fresh chunk, a decode, a chunk after cache
    case = _case(q_lens, kv_lens, torch.float32)
    q, k, v, k_cache, v_cache, tables = case
    sdpa = attention.paged_attention(
        q, k, v, k_cache.clone(), v_cache.clone(),
        AttentionMetadata.build(q_lens, kv_lens, tables, BLOCK, native_kernel=False),
    )  # fmt: skip
    in_kernel = AttentionMetadata.build(q_lens, kv_lens, tables, BLOCK, all_in_kernel=True)
    assert all(isinstance(g, KernelGroup) for g in in_kernel.groups)
    outputs = on_one_and_two_threads(
        lambda: attention.paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), in_kernel)
    )
    torch.testing.assert_close(outputs[0], sdpa, atol=1e-5, rtol=1e-5)
    assert torch.equal(outputs[0], outputs[1])  # the split changes no bit


def _reference(q, k_cache, v_cache, table, visible, block_size):
    """Each query's attention over its first `visible` positions, by torch in fp32."""
    slots = torch.tensor([table[p // block_size] * block_size + p % block_size
                          for p in range(int(visible.max()))])  # fmt: skip
    keys, values = k_cache[slots].float(), v_cache[slots].float()  # [P, KVH, D]
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("nhd,phd->nhp", q.float(), keys) * q.shape[-1] ** -0.5
    hidden = torch.arange(scores.shape[-1])[None, :] >= visible[:, None]  # [N, P]
    weights = scores.masked_fill(hidden[:, None, :], float("-inf")).softmax(-1)
    return torch.einsum("nhp,phd->nhd", weights, values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "block"), [(16, 4), (24, 16), (64, 16), (80, 8)])
def test_a_query_is_bit_for_bit_the_same_alone_or_in_a_chunk(dtype, head_dim, block):
    """Head dims that leave a tail past the kernel's vectors, blocks its tiles split; the
    chunk's queries each alone, as a decode would compute them, and against torch."""
    gen = torch.Generator().manual_seed(head_dim)
    cached, chunk = 11, 21  # 11 positions from the cache, then a chunk of 21 queries
    table = torch.randperm(16, generator=gen)[: -(-(cached + chunk) // block)].tolist()
    k_cache = torch.randn(16 * block, KV_HEADS, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(16 * block, KV_HEADS, head_dim, generator=gen).to(dtype)
    q = torch.randn(chunk, HEADS, head_dim, generator=gen).to(dtype)
    tables = torch.tensor([table])
    visible = torch.arange(cached + 1, cached + chunk + 1)
    together = kernels.paged_attention(
        q, k_cache, v_cache, tables, torch.zeros(chunk, dtype=torch.long), visible, block
    )
    for i in range(chunk):
        alone = kernels.paged_attention(
            q[i : i + 1],
            k_cache,
            v_cache,
            tables,
            torch.zeros(1, dtype=torch.long),
            visible[i : i + 1],
            block,
        )
        assert torch.equal(alone, together[i : i + 1]), i
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    expected = _reference(q, k_cache, v_cache, table, visible, block)
    torch.testing.assert_close(together.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_query_is_bit_for_bit_the_same_in_chunks_of_any_size(dtype):
    """The model's shape (three query heads a KV head, head dim 64): a verification step's
    1 + k queries, or a prefill chunk, put a query's rows at other places in the kernel's
    four-row groups than a decode does; its attention may not change by a bit."""
    gen = torch.Generator().manual_seed(7)
    block, head_dim, cached, span = 16, 64, 20, 12
    k_cache = torch.randn(4 * block, KV_HEADS, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(4 * block, KV_HEADS, head_dim, generator=gen).to(dtype)
    q = torch.randn(span, HEADS, head_dim, generator=gen).to(dtype)
    tables = torch.tensor([[2, 0, 3, 1]])
    visible = torch.arange(cached + 1, cached + span + 1)

    def attend(first: int, size: int) -> torch.Tensor:
        rows = slice(first, first + size)
        seq = torch.zeros(size, dtype=torch.long)
        return kernels.paged_attention(q[rows], k_cache, v_cache, tables, seq, visible[rows], block)

    alone = torch.cat([attend(i, 1) for i in range(span)])
    for size in range(2, 10):
        for first in range(span - size + 1):
            assert torch.equal(attend(first, size), alone[first : first + size]), (first, size)
