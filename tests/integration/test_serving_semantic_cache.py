"""The semantic cache through real Serve: two ingress replicas sharing a Redis backend (a
real redis-server started here), the real model embedding on the interactive pool, the
real `openai` client reading hits and generations alike.

The threshold is configs/local.yaml's (calibrated by `tierserve cache calibrate`); which
side of it each candidate question falls on is read from the embeddings calibration makes.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest

from cli.cache import calibration_engine, embed_texts
from serving.app_config import load_config
from serving.cache.semantic_cache import HEADER
from testing.redis_server import redis_server
from testing.serve_harness import exact_config, metric, request_replica, serving

MODEL = "SmolLM2-135M-Instruct"
ASKED = "How do I reset my password?"
REPEAT = "how do I reset my   PASSWORD?"
CANDIDATES = [
    "HOW DO I RESET MY PASSWORD?",  # the same once normalized: similarity 1, above any threshold
    "How do I reset my password",
    "How can I reset my password?",
    "How do I reset my own password?",
    "How do I reset my username?",
    "How do I change my password?",
    "What is the capital of France?",
]
"""Paraphrases and near misses of ASKED (from data/semantic_cache/ and alike)."""
THRESHOLD = load_config("configs/local.yaml").semantic_cache.threshold
NUM_REPEATS = 8
"""Repeats sent after the first answer: Serve's proxy spreads them over both ingress
replicas (all on one has a chance of 2 x 2^-8)."""


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with redis_server() as redis_url:
        cache = load_config("configs/local.yaml").semantic_cache.model_copy(
            update={"enabled": True, "backend": "redis", "redis_url": redis_url,
                    "namespace": f"test-{uuid.uuid4().hex}", "check_fraction": 1.0}
        )  # fmt: skip
        with serving(exact_config(semantic_cache=cache, ingress_num_replicas=2)) as url:
            yield url


@pytest.fixture
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def _ask(client: openai.OpenAI, question: str, **fields: object):
    """A chat request, greedy and 16 tokens unless `fields` say otherwise; (the parsed
    completion, the response headers)."""
    settings: dict = {"temperature": 0, "max_tokens": 16, **fields}
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": question}], **settings
    )
    return raw.parse(), raw.headers


def test_a_repeat_hits_on_both_replicas_through_redis(client: openai.OpenAI) -> None:
    """Asked again in other case and spacing (the same text once normalized): every repeat
    is a hit, on whichever replica the proxy picks, the other one reading the entry
    from Redis (its own memory never saw the text)."""
    first, headers = _ask(client, ASKED)
    assert headers[HEADER] == "miss"
    stored_by = request_replica(headers["x-tierserve-request-id"])
    replicas = set()
    for _ in range(NUM_REPEATS):
        hit, headers = _ask(client, REPEAT)
        assert headers[HEADER] == "hit", headers
        assert float(headers[f"{HEADER}-similarity"]) >= THRESHOLD
        assert hit.choices[0].message.content == first.choices[0].message.content
        assert hit.id != first.id
        replicas.add(request_replica(headers["x-tierserve-request-id"]))
    assert len(replicas) == 2 and stored_by in replicas


def test_hit_above_the_threshold_and_miss_below(client: openai.OpenAI) -> None:
    """Each candidate is a hit exactly when its similarity to the stored question, as
    `tierserve cache calibrate` embeds both (an engine of the pool's settings in this
    process), reaches the threshold; both sides occur."""
    _ask(client, ASKED)  # stored (or already there)
    vectors = embed_texts(calibration_engine(load_config("configs/local.yaml")),
                          [ASKED, *CANDIDATES])  # fmt: skip
    outcomes = set()
    for candidate in CANDIDATES:
        similarity = float(vectors[ASKED] @ vectors[candidate])
        if abs(similarity - THRESHOLD) < 2e-4:
            continue  # too close to call between a batched and a lone embedding
        _, headers = _ask(client, candidate)
        above = similarity >= THRESHOLD
        assert headers[HEADER] == ("hit" if above else "miss"), (candidate, similarity)
        outcomes.add(above)
    assert outcomes == {True, False}


@pytest.mark.parametrize(
    "change",
    [
        {"temperature": 0.5, "seed": 7},
        {"max_tokens": 8},
        {"response_format": {"type": "json_object"}},
        {"tools": [{"type": "function", "function": {"name": "reset", "parameters": {}}}],
         "tool_choice": "none"},
        {"extra_body": {"top_k": 5}},
    ],
)  # fmt: skip
def test_no_hit_across_sampling_tools_or_format(client: openai.OpenAI, change: dict) -> None:
    _ask(client, ASKED)  # stored (or already there)
    _, headers = _ask(client, ASKED, **change)
    assert headers[HEADER] == "miss"


def test_a_streamed_hit_parses_like_a_generated_answer(client: openai.OpenAI) -> None:
    question = "What is the capital of France?"
    generated = _stream(client, question, {"cache": False})
    _ask(client, question)  # stored
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": question.upper()}], temperature=0,
        max_tokens=16, stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    assert raw.headers[HEADER] == "hit"
    chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (text, _finish(chunks)) == generated[:2]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == generated[2]


def test_opting_out_by_body_header_or_tier_skips_the_cache(base_url: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": ASKED}],
            "temperature": 0, "max_tokens": 16}  # fmt: skip
    url = f"{base_url}/v1/chat/completions"
    assert httpx.post(url, json=body, timeout=120).headers[HEADER] in ("hit", "miss")
    for response in (
        httpx.post(url, json={**body, "cache": False}, timeout=120),
        httpx.post(url, json=body, headers={HEADER: "off"}, timeout=120),
        httpx.post(url, json=body, headers={"X-SLA-Tier": "interactive"}, timeout=120),
        httpx.post(url, json={**body, "temperature": 0.7}, timeout=120),  # not deterministic
    ):
        assert response.status_code == 200 and HEADER not in response.headers


def test_hits_and_misses_are_counted(base_url: str, client: openai.OpenAI) -> None:
    _ask(client, ASKED)
    _ask(client, REPEAT)
    hits = misses = 0.0
    for _ in range(8):  # /metrics comes from either replica: read both
        hits = max(hits, _count(base_url, "tierserve:semantic_cache_hits_total"))
        misses = max(misses, _count(base_url, "tierserve:semantic_cache_misses_total"))
    assert hits >= 1 and misses >= 1


def _stream(client: openai.OpenAI, question: str, extra_body: dict) -> tuple[str, str, int]:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], temperature=0,
        max_tokens=16, stream=True, stream_options={"include_usage": True},
        extra_body=extra_body,
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, _finish(chunks), chunks[-1].usage.completion_tokens


def _count(base_url: str, name: str) -> float:
    """A replica's count for the standard tier (0 before its first: no sample yet)."""
    try:
        return metric(base_url, name, tier="standard")
    except KeyError:
        return 0.0


def _finish(chunks: list) -> str:
    return [c.choices[0].finish_reason for c in chunks if c.choices][-1]
