"""A quantized KV cache (engine.quant.kv): its rows, the C kernel against the torch path
over it, the capacity it buys, and an engine serving from it: greedy quality against the
model-dtype cache over the quality prompts, the same tokens through prefix reuse,
preemption and speculation, and seeded requests reproducible cold, warm and busy."""

from __future__ import annotations

import pytest
import torch

from bench.engine.bench_memory import compare_scores, continuation_scores
from bench.engine.quant_quality import read_rows
from engine.config import EngineConfig, SpecDecodeConfig
from engine.kernels import hadamard as hadamard_kernel
from engine.kernels import paged_attention as kernels
from engine.model import attention
from engine.model.attention import AttentionMetadata, KernelGroup
from engine.model.model_runner import kv_blocks_for_memory
from engine.quant import kv
from engine.quant.awq import DEFAULT_CALIBRATION_PATH
from engine.sampling_params import SamplingParams
from testing.engine_helpers import Completion, greedy, run_requests, scattered_block_tables

KV_DTYPES = ["int8", "fp8_e4m3"]
STORAGE = {"int8": torch.int8, "fp8_e4m3": torch.uint8}
MIN_TOP1 = {"int8": 0.99, "fp8_e4m3": 0.93}
"""Teacher-forced top-1 agreement with the fp32 cache over 16 quality prompts: issue 31's
target for int8 (0.995 here, rotated; 0.984 before the rotation), a floor against
regressions for fp8 (over all 64: int8 0.993, fp8 0.970)."""
MAX_PPL_CHANGE = {"int8": 0.01, "fp8_e4m3": 0.02}
NGRAM = SpecDecodeConfig(method="ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=3)
TIGHT = dict(block_size=4, num_kv_blocks=16, max_num_batched_tokens=16, max_num_seqs=8)
"""64 slots for 4 requests of up to ~50 tokens: some are preempted and recomputed."""
PROMPTS = [
    "The lighthouse keeper wrote in her log every night: the wind, the ships, the sea.",
    "def fibonacci(n):",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "Once upon a time, in a small village at the edge of a great forest, there lived",
]
SEEDED = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234, logprobs=5)
BLOCK, HEADS, KV_HEADS = 4, 6, 2

needs_kernel = pytest.mark.skipif(
    not kernels.available(torch.float32), reason="no C compiler to build the kernel"
)


def test_unknown_kv_cache_dtype_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of .*'int8'"):
        EngineConfig(kv_cache_dtype="int4")


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_rows_round_trip_within_half_a_code(kv_dtype):
    storage = STORAGE[kv_dtype]
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 2, 50)[:, None, None]
    x[0] = 0.0
    rows = kv.quantize(x, storage)
    assert rows.shape == (50, 3, 64 + kv.SCALE_BYTES) and rows.dtype == storage
    back = kv.dequantize(rows, torch.float32)
    assert torch.equal(back[0], x[0])
    amax = x.abs().amax(-1, keepdim=True)
    if storage == torch.int8:
        bound = amax / 127 / 2 * 1.004  # the scale rounded to bf16 (8 bits)
    else:  # 3 mantissa bits; subnormal steps of 2^-9 of the scale near zero
        bound = x.abs() * 2**-4 + amax / 448 * 2**-10 * 1.01
    assert ((back - x).abs() <= bound + 1e-30).all()


def _sylvester_hadamard(size: int) -> torch.Tensor:
    """The normalized Hadamard matrix of `size` (a power of two), built as its definition."""
    h = torch.ones(1, 1)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / size**0.5


@pytest.mark.parametrize(("head_dim", "block"), [(64, 64), (128, 128), (96, 32), (80, 16)])
def test_rotation_is_the_hadamard_transform_over_blocks_and_its_own_inverse(head_dim, block):
    x = torch.randn(7, 3, head_dim, dtype=torch.float64).float()
    rotated = kv.rotate_reference(x)
    by_matrix = (x.view(7, 3, head_dim // block, block) @ _sylvester_hadamard(block)).view_as(x)
    torch.testing.assert_close(rotated, by_matrix, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv.rotate_reference(rotated), x, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 96, 80])
def test_rotation_kernel_is_bit_for_bit_the_torch_reference(head_dim, dtype):
    if not hadamard_kernel.takes(torch.zeros(1, dtype=dtype)):
        pytest.skip("no C compiler: the torch path runs")
    x = (torch.randn(5, 9, head_dim) * 3).to(dtype)
    assert torch.equal(hadamard_kernel.hadamard(x, head_dim & -head_dim), kv.rotate_reference(x))
    assert torch.equal(kv.rotate(x), kv.rotate_reference(x))


@pytest.mark.parametrize("rotate", [kv.rotate, kv.rotate_reference])
def test_rotation_of_a_row_is_bit_for_bit_the_same_alone_or_in_a_batch(rotate):
    x = torch.randn(33, 9, 64).to(torch.bfloat16)
    assert torch.equal(rotate(x)[17], rotate(x[17:18])[0])


def test_rotation_shrinks_the_int8_error_of_keys_with_outlier_channels():
    """What the rotation is for: a key's few large channels set its row's scale."""
    keys = torch.randn(256, 2, 64)
    keys[..., :4] *= 20.0  # the channels RoPE turns slowest, as in the model's keys
    plain = kv.dequantize(kv.quantize(keys, torch.int8), torch.float32)
    rotated = kv.rotate(kv.dequantize(kv.quantize(kv.rotate(keys), torch.int8), torch.float32))
    assert (rotated - keys).norm() < 0.5 * (plain - keys).norm()


@pytest.mark.parametrize("native_kernel", [False, pytest.param(True, marks=needs_kernel)])
def test_attention_on_a_quantized_cache_is_attention_over_the_values_written(native_kernel):
    """paged_attention rotates q, K and V for a quantized cache and its output back: a
    decode reading its context from the cache sees the K/V a prefill wrote, to int8."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(5, heads, 64, generator=gen) for heads in (HEADS, KV_HEADS, KV_HEADS))
    k_cache, v_cache = (kv.allocate(2 * BLOCK, KV_HEADS, 64, torch.int8, "cpu") for _ in range(2))
    for q_lens, kv_lens in (([4], [4]), ([1], [5])):  # the prefill, then a decode
        meta = AttentionMetadata.build(q_lens, kv_lens, [[1, 0]], BLOCK,
                                       native_kernel=native_kernel)  # fmt: skip
        new = slice(kv_lens[0] - q_lens[0], kv_lens[0])
        out = attention.paged_attention(q[new], k[new], v[new], k_cache, v_cache, meta)
    assert not torch.equal(kv.dequantize(v_cache[:1], torch.float32), v[4:])  # stored rotated
    exact = torch.nn.functional.scaled_dot_product_attention(
        q[4:].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), enable_gqa=True
    ).transpose(0, 1)
    torch.testing.assert_close(out, exact, atol=0.03, rtol=0.03)


def _case(q_lens: list[int], kv_lens: list[int], dtype: torch.dtype, storage, head_dim=16):
    """Random quantized cache contents over scattered blocks, and this step's q/k/v."""
    gen = torch.Generator().manual_seed(sum(kv_lens))
    num_blocks, tables = scattered_block_tables(kv_lens, BLOCK, gen)
    k_cache, v_cache = (
        kv.quantize(torch.randn(num_blocks * BLOCK, KV_HEADS, head_dim, generator=gen), storage)
        for _ in range(2)
    )
    q, k, v = (
        torch.randn(sum(q_lens), heads, head_dim, generator=gen).to(dtype)
        for heads in (HEADS, KV_HEADS, KV_HEADS)
    )
    return q, k, v, k_cache, v_cache, tables


@needs_kernel
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(
    ("q_lens", "kv_lens"),
    [([1], [2]), ([1, 1, 1], [5, 17, 33]), ([3, 1, 5], [9, 40, 12]), ([1, 20, 2], [8, 20, 30])],
)
def test_kernel_on_a_quantized_cache_matches_the_torch_path(
    q_lens, kv_lens, dtype, tolerance, kv_dtype
):
    """Queries with cached context: the torch path dequantizes what it gathers (a fresh
    sequence's queries there attend to their own K/V, unquantized)."""
    q, k, v, k_cache, v_cache, tables = _case(q_lens, kv_lens, dtype, STORAGE[kv_dtype])
    outputs = []
    for native in (False, True):
        meta = AttentionMetadata.build(q_lens, kv_lens, tables, BLOCK, "cpu", dtype, native)
        assert any(isinstance(g, KernelGroup) for g in meta.groups) == native
        outputs.append(attention.paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta))
    torch.testing.assert_close(outputs[1].float(), outputs[0].float(), atol=tolerance,
                               rtol=tolerance)  # fmt: skip


@needs_kernel
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("head_dim", [20, 64, 80])
def test_a_query_on_a_quantized_cache_is_bit_for_bit_the_same_alone_or_in_a_chunk(
    kv_dtype, head_dim
):
    """Head dim 20 leaves a tail past the kernel's vectors, read code by code."""
    q, _, _, k_cache, v_cache, tables = _case([21], [32], torch.float32, STORAGE[kv_dtype],
                                              head_dim)  # fmt: skip
    table, visible = torch.tensor(tables), torch.arange(12, 33)

    def attend(rows: slice) -> torch.Tensor:
        seq = torch.zeros(rows.stop - rows.start, dtype=torch.long)
        return kernels.paged_attention(q[rows], k_cache, v_cache, table, seq, visible[rows], BLOCK)

    together = attend(slice(0, 21))
    for i in range(21):
        assert torch.equal(attend(slice(i, i + 1)), together[i : i + 1]), i


@needs_kernel
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_the_kernel_decodes_every_code_as_torch_does(kv_dtype):
    """One visible position: a query's output is that position's value row exactly."""
    storage = STORAGE[kv_dtype]
    if storage == torch.int8:
        codes = torch.arange(-127, 129).clamp(max=127).to(torch.int8)
    else:  # every e4m3 code but the two NaNs, which quantization never writes
        codes = torch.arange(256)
        codes = codes.masked_fill((codes == 0x7F) | (codes == 0xFF), 0).to(torch.uint8)
    scale = torch.tensor([0.75], dtype=torch.bfloat16).view(storage).expand(4, 1, 2)
    v_cache = torch.cat([codes.view(4, 1, 64), scale], dim=-1).repeat_interleave(BLOCK, 0)
    k_cache = torch.zeros_like(v_cache)
    tables, one_each = torch.arange(4)[:, None], torch.ones(4, dtype=torch.long)
    q = torch.randn(4, 1, 64)
    out = kernels.paged_attention(q, k_cache, v_cache, tables, torch.arange(4), one_each, BLOCK)
    expected = kv.dequantize(v_cache[::BLOCK], torch.float32)
    assert torch.equal(out, expected)


def test_a_quantized_pool_holds_3_9x_the_blocks_of_an_fp32_one(engine):
    budget = dict(dtype="float32", kv_cache_memory_gb=0.25)
    auto = kv_blocks_for_memory(engine.model, EngineConfig(**budget))
    for kv_dtype in KV_DTYPES:
        blocks = kv_blocks_for_memory(engine.model, EngineConfig(kv_cache_dtype=kv_dtype, **budget))
        assert blocks / auto == pytest.approx(256 / 66, rel=0.01)  # 64 fp32 vs 64 + 2 bytes


def test_stats_report_the_pools_capacity(make_engine):
    engine = make_engine(kv_cache_dtype="int8", max_model_len=256)
    stats = engine.stats()
    assert (stats.num_kv_blocks, stats.kv_cache_dtype) == (64, "int8")
    assert stats.kv_max_num_seqs == 64 // (256 // 16)


@pytest.fixture(scope="module")
def quality_rows() -> list[dict]:
    """The first 16 quality prompts."""
    return read_rows(DEFAULT_CALIBRATION_PATH)[:16]


@pytest.fixture(scope="module")
def fp32_cache_scores(make_engine, quality_rows) -> list[list[tuple[float, int]]]:
    """The fp32 cache's continuation scores: the baseline of every KV dtype, scored once."""
    return continuation_scores(make_engine(), quality_rows)


@pytest.mark.slow  # left out of `make test-fast`; `make test` runs it
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_greedy_on_a_quantized_cache_agrees_with_the_fp32_cache(
    make_engine, quality_rows, fp32_cache_scores, kv_dtype
):
    quantized = continuation_scores(make_engine(kv_cache_dtype=kv_dtype), quality_rows)
    quality = compare_scores(fp32_cache_scores, quantized)
    assert quality["top1_agreement"] >= MIN_TOP1[kv_dtype], quality
    assert quality["ppl_ratio"] == pytest.approx(1.0, abs=MAX_PPL_CHANGE[kv_dtype]), quality


def _greedy_runs(engine, prompts: list[list[int]], together: bool) -> list[Completion]:
    params = greedy(24, logprobs=2)
    if together:
        done = run_requests(engine, {f"p{i}": (p, params) for i, p in enumerate(prompts)})
        return [done[f"p{i}"] for i in range(len(prompts))]
    return [run_requests(engine, {"only": (p, params)})["only"] for p in prompts]


@pytest.mark.slow  # left out of `make test-fast`; `make test` runs it
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_greedy_is_the_same_through_prefix_reuse_preemption_and_speculation(
    make_engine, tokenizer, kv_dtype
):
    """Each prompt alone, then again from the prefix cache, then all together with drafts;
    on a pool too small for them, alone and then together (preempted). The block size
    sets the kernel's order over the context, so each pool is compared with itself."""
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    plain = make_engine(kv_cache_dtype=kv_dtype)
    cold = _greedy_runs(plain, prompts, together=False)
    warm = _greedy_runs(plain, prompts, together=False)
    assert sum(run.num_cached_tokens > 0 for run in warm) >= 2
    speculating = make_engine(kv_cache_dtype=kv_dtype, spec_decode=NGRAM)
    speculated = _greedy_runs(speculating, prompts, together=True)
    assert speculating.stats().spec_num_draft_tokens > 0
    tight = make_engine(kv_cache_dtype=kv_dtype, **TIGHT)
    alone = _greedy_runs(tight, prompts, together=False)
    preempted = _greedy_runs(tight, prompts, together=True)
    assert tight.stats().num_preemptions > 0
    for runs, expected in ((warm, cold), (speculated, cold), (preempted, alone)):
        assert [r.token_ids for r in runs] == [r.token_ids for r in expected]
        assert [r.logprobs for r in runs] == [r.logprobs for r in expected]


def _busy(engine, prompt: list[int]) -> Completion:
    """The seeded request beside five others of different lengths and settings."""
    others = {
        f"other-{i}": (
            engine.tokenizer.encode(f"Question {i}: why is {i * 7} interesting? " * (i + 1)),
            SamplingParams(max_tokens=8 + 4 * i, temperature=1.0 if i % 2 else 0.0),
        )
        for i in range(5)
    }
    return run_requests(engine, {**others, "seeded": (prompt, SEEDED)})["seeded"]


@pytest.mark.slow  # left out of `make test-fast`; `make test` runs it
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_seeded_request_on_a_quantized_cache_is_identical_cold_warm_busy(make_engine, kv_dtype):
    runs: list[Completion] = []
    for spec_decode in (None, NGRAM):
        engine = make_engine(kv_cache_dtype=kv_dtype, spec_decode=spec_decode)
        prompt = engine.tokenizer.encode(PROMPTS[0] + " The lighthouse keeper wrote")
        runs.append(run_requests(engine, {"seeded": (prompt, SEEDED)})["seeded"])
        runs.append(run_requests(engine, {"seeded": (prompt, SEEDED)})["seeded"])
        assert runs[-1].num_cached_tokens > 0
        runs.append(_busy(engine, prompt))
    assert all(run.token_ids == runs[0].token_ids for run in runs), [r.text for r in runs]
    assert all(run.logprobs == runs[0].logprobs for run in runs)
