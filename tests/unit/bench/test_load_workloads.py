"""The locust load's request shapes and SLOs (bench.traffic.workloads): pure Python, no server."""

from __future__ import annotations

import random
import statistics

import pytest

from bench.paths import REPO_ROOT
from bench.traffic.workloads import (
    DEFAULT_SLOS,
    ChatRequest,
    Corpus,
    LogNormal,
    Slo,
    chat_request,
    classify_request,
    estimate_tokens,
    load_slos,
    rag_request,
)

CORPUS = Corpus.load()
NUM_SAMPLES = 300


def _prompt_tokens(request: ChatRequest) -> int:
    return estimate_tokens(request.messages[-1]["content"])


def test_default_slos_are_those_of_the_local_config() -> None:
    assert load_slos(REPO_ROOT / "configs" / "local.yaml") == DEFAULT_SLOS


def test_slo_checks_ttft_and_tpot_but_only_ttft_for_one_token() -> None:
    slo = Slo(ttft_ms=400, tpot_ms=25)
    assert slo.met_by(400, 25)
    assert not slo.met_by(401, 10)
    assert not slo.met_by(100, 26)
    assert slo.met_by(100, None)


def test_log_normal_has_its_median_and_stays_clipped() -> None:
    shape = LogNormal(median=100, sigma=1.0, low=20, high=400)
    rng = random.Random(0)
    samples = [shape.sample(rng) for _ in range(2000)]
    assert 90 <= statistics.median(samples) <= 110
    assert min(samples) == 20 and max(samples) == 400  # the tails reach both clips


@pytest.mark.parametrize("seed", range(3))
def test_rag_prompts_hold_a_1_to_2k_token_document_and_its_answer(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(50):
        request = rag_request(CORPUS, rng)
        content = request.messages[-1]["content"]
        question = content.rsplit("Question: ", 1)[1]
        answer = next(p for p in CORPUS.passages if p.question == question)
        assert answer.text in content
        assert 1000 <= _prompt_tokens(request) <= 2300


def test_chat_lengths_are_long_tailed() -> None:
    rng = random.Random(0)
    requests = [chat_request(CORPUS, rng) for _ in range(NUM_SAMPLES)]
    prompt_tokens = [_prompt_tokens(r) for r in requests]
    output_tokens = [r.max_tokens for r in requests]
    for lengths in (prompt_tokens, output_tokens):
        assert statistics.mean(lengths) > statistics.median(lengths)  # right-skewed
    assert 150 <= statistics.median(prompt_tokens) <= 260
    assert max(prompt_tokens) > 3 * statistics.median(prompt_tokens)


def test_classification_is_a_short_prompt_and_a_few_tokens() -> None:
    rng = random.Random(0)
    requests = [classify_request(CORPUS, rng) for _ in range(NUM_SAMPLES)]
    assert {r.max_tokens for r in requests} == {1, 2, 3, 4, 5}
    assert max(_prompt_tokens(r) for r in requests) < 64


def test_body_streams_with_usage_and_the_sampled_length() -> None:
    body = classify_request(CORPUS, random.Random(0)).body()
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] and 1 <= body["max_tokens"] <= 5
