"""The Triton paged-attention kernel (a GPU's short queries) against the padded torch path,
on CPU tensors under Triton's interpreter, and on CUDA where a GPU is lent.

The interpreter is chosen when triton is imported, and the suite imports it compiled; so
the interpreted check runs in a process of its own with TRITON_INTERPRET=1 (this file
run as a script)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.model import attention
from engine.model.attention import AttentionMetadata, KernelGroup
from testing.engine_helpers import scattered_block_tables

HEADS, KV_HEADS = 6, 2
CASES = (  # (q_lens, kv_lens): decodes and a verification's rows, across block edges
    ([1, 1, 5], [1, 37, 20]),
    ([1, 3], [16, 17]),
)


def _case(q_lens, kv_lens, head_dim, block, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks, tables = scattered_block_tables(kv_lens, block, gen)
    caches = [torch.randn(num_blocks * block, KV_HEADS, head_dim, generator=gen) for _ in "kv"]
    q = torch.randn(sum(q_lens), HEADS, head_dim, generator=gen)
    k, v = (torch.randn(sum(q_lens), KV_HEADS, head_dim, generator=gen) for _ in "kv")
    moved = [t.to(device=device, dtype=dtype) for t in (q, k, v, *caches)]
    return (*moved, tables)


def _torch_path(q_lens, kv_lens, head_dim, block, dtype, device) -> torch.Tensor:
    q, k, v, k_cache, v_cache, tables = _case(q_lens, kv_lens, head_dim, block, dtype, device)
    meta = AttentionMetadata.build(
        q_lens, kv_lens, tables, block, device, dtype, native_kernel=False
    )
    assert not any(isinstance(g, KernelGroup) for g in meta.groups)
    return attention.paged_attention(q, k, v, k_cache, v_cache, meta)


def _kernel_path(q_lens, kv_lens, head_dim, block, dtype, device) -> torch.Tensor:
    """The same step through the Triton kernel, fed the group the engine builds for it."""
    from engine.kernels.paged_attention_triton import paged_attention_triton

    q, k, v, k_cache, v_cache, tables = _case(q_lens, kv_lens, head_dim, block, dtype, device)
    meta = AttentionMetadata.build(
        q_lens, kv_lens, tables, block, device, dtype, native_kernel=False
    )
    attention.paged_attention(q, k, v, k_cache, v_cache, meta)  # writes this step's K/V
    group = attention._kernel_group(meta.layout.seqs, block, True, device)
    return paged_attention_triton(
        q, k_cache, v_cache, group.block_tables, group.query_seq, group.visible, block
    )


def check_every_case(device: str) -> None:
    """Kernel against the torch path for head dims 64 and 24 (not a power of two), blocks of
    16 and 4, fp32 and bf16, grouped-query heads."""
    for q_lens, kv_lens in CASES:
        for head_dim, block in ((64, 16), (24, 4)):
            for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
                args = (q_lens, kv_lens, head_dim, block, dtype, device)
                actual, expected = _kernel_path(*args), _torch_path(*args)
                assert actual.dtype == dtype and actual.shape == expected.shape
                torch.testing.assert_close(actual, expected, atol=tolerance, rtol=tolerance)


def test_the_kernel_matches_the_torch_path_under_the_interpreter() -> None:
    env = os.environ | {"TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, str(Path(__file__))], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert "checked" in run.stdout


def test_a_gpu_engine_sends_short_queries_to_the_triton_kernel() -> None:
    """On CUDA the metadata gives the in-place group, with its tensors on the device."""
    assert attention.kernel_serves("cuda", torch.bfloat16)
    assert not attention.kernel_serves("cuda", torch.int8)
    group = attention._kernel_group(
        [attention._Seq(1, 9, [2], 0)], block_size=16, whole_batch=True, device="meta"
    )
    assert group.thread_bounds is None  # not the CPU kernel's
    assert group.visible.device.type == group.block_tables.device.type == "meta"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_kernel_matches_the_torch_path_on_cuda() -> None:
    check_every_case("cuda")


if __name__ == "__main__":
    check_every_case("cpu")
    print("checked")
