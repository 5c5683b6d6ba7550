"""bench_memory's settings build valid engines that fit their round, and its comparison."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench.engine.bench_memory import (
    FULL,
    QUANTIZED,
    QUICK,
    VLLM_SCRIPT,
    compare_scores,
    continuation_scores,
    engine_config,
    floor_scores,
    measure_vllm,
    vllm_job,
)  # fmt: skip
from bench.engine.quant_quality import read_rows
from engine.config import KV_CACHE_DTYPES
from engine.engine import LLMEngine
from engine.quant.awq import DEFAULT_CALIBRATION_PATH

FP32_KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4
"""The default model's K and V of one token in fp32: 30 layers, 3 KV heads of 64."""


@pytest.mark.parametrize("settings", [FULL, QUICK], ids=["full", "quick"])
def test_every_kv_dtype_gets_a_valid_engine_with_room_for_the_long_round(settings):
    for kv_dtype in KV_CACHE_DTYPES:
        config = engine_config(kv_dtype, settings, threads=2)
        assert config.kv_cache_dtype == kv_dtype
        assert config.max_num_seqs >= settings.num_seqs
    tokens = settings.num_seqs * (settings.context_len + settings.num_decode_tokens + 16)
    assert tokens * FP32_KV_BYTES_PER_TOKEN <= settings.kv_cache_memory_gb * 2**30
    assert settings.context_len + settings.num_decode_tokens <= settings.max_model_len
    assert set(QUANTIZED) == set(KV_CACHE_DTYPES) - {"auto"}


def test_compare_scores_counts_top1_and_perplexity_over_all_positions():
    base = [[(-0.5, 1), (-1.0, 2)], [(-2.0, 3)]]
    other = [[(-0.5, 1), (-1.0, 9)], [(-2.3, 3)]]
    quality = compare_scores(base, other)
    assert quality["top1_agreement"] == pytest.approx(2 / 3)
    assert quality["ppl_ratio"] == pytest.approx(2.718281828 ** (0.3 / 3))
    assert quality["logprob_err_max"] == pytest.approx(0.3)


@pytest.mark.slow  # left out of `make test-fast`; `make test` runs it
def test_the_floor_scores_the_same_cache_by_another_exact_path():
    """Torch's attention rounds differently from the kernel's (some logprob moves) and is
    exact all the same (top-1 kept nearly everywhere)."""
    rows = read_rows(DEFAULT_CALIBRATION_PATH)[:2]
    kernel = continuation_scores(LLMEngine(engine_config("auto", QUICK, threads=1)), rows)
    quality = compare_scores(kernel, floor_scores(QUICK, threads=1, rows=rows))
    assert quality["logprob_err_max"] > 0
    assert quality["top1_agreement"] >= 0.9


def test_vllms_job_holds_the_same_prompts_and_rows_as_tierserves_side():
    rows = read_rows(DEFAULT_CALIBRATION_PATH)[:2]
    job = json.loads(json.dumps(vllm_job("fp8", QUICK, rows)))
    assert job["kv_cache_dtype"] == "fp8" and Path(job["model"], "config.json").exists()
    assert [len(p) for p in job["long_prompts"]] == [QUICK.context_len] * QUICK.num_seqs
    assert job["rows"][1]["reference_ids"] == rows[1]["reference_ids"]
    assert job["llm_args"]["max_num_seqs"] >= QUICK.num_seqs
    assert VLLM_SCRIPT.exists()


def test_a_vllm_side_that_cannot_start_fails_with_its_log():
    """Here the script runs under this venv's python, which has no vllm."""
    rows = read_rows(DEFAULT_CALIBRATION_PATH)[:1]
    with pytest.raises(RuntimeError, match=r"(?s)vLLM's side failed.*No module named 'vllm'"):
        measure_vllm(Path(sys.executable), "fp8", QUICK, threads=1, rows=rows)
