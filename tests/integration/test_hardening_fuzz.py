"""Property-based fuzz of both completion endpoints through real Ray Serve and HTTP (fake
engine pools): whatever the body, headers or key, the answer has a status the API
documents and is OpenAI-shaped JSON (or a well-formed SSE stream), never a bare 500, and
the server keeps serving afterwards.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving.config import RequestLimits
from serving.gateway_config import ApiKeyConfig, GatewayConfig
from testing.fakes import FakeEngine
from testing.serve_harness import fake_config, serving

MODEL = "SmolLM2-135M-Instruct"
KEY = "fuzz-key"
ALLOWED_STATUSES = {200, 400, 401, 403, 404, 408, 413, 429}
FIELDS = [
    "model", "prompt", "messages", "n", "stream", "stream_options", "temperature", "top_p",
    "top_k", "min_tokens", "repetition_penalty", "seed", "stop", "max_tokens",
    "max_completion_tokens", "tier", "ignore_eos", "logprobs", "unknown_field",
    "presence_penalty", "frequency_penalty", "logit_bias", "min_p", "stop_token_ids",
    "include_stop_str_in_output", "skip_special_tokens", "user", "best_of", "echo",
    "response_format", "tools", "tool_choice", "parallel_tool_calls", "service_tier",
]  # fmt: skip


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    base = fake_config()
    # Short context and deadlines: any request the fuzzer lets through ends within seconds.
    tiers = tuple(t.model_copy(update={"deadline_s": 5.0}) for t in base.tiers)
    gateway = GatewayConfig(
        require_api_key=True,
        api_keys=(
            ApiKeyConfig(name="fuzz", key=KEY),
            ApiKeyConfig(name="batch-only", key="batch-only", allowed_tiers=("batch",)),
        ),
    )
    config = fake_config(
        max_model_len=64,
        tiers=tiers,
        gateway=gateway,
        limits=RequestLimits(max_body_bytes=64 * 1024),
        request_timeout_s=10.0,
        graceful_shutdown_timeout_s=10.0,
    )
    with serving(config, FakeEngine) as url:
        yield url


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


scalars = st.one_of(
    st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e-300, -0.0, 2**64, -(2**63) - 1]),
    st.sampled_from(["NaN", "inf", "0.5", "-1", "1e999", "\ud800", "a\udfffb", "", "interactive"]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.text(max_size=12),
    st.booleans(),
    st.none(),
)
content_parts = st.lists(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url", "input_audio", "bogus"])},
        optional={"text": st.one_of(st.text(max_size=8), st.integers()), "image_url": scalars},
    ),
    max_size=3,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool", "robot"])},
        optional={"content": st.one_of(st.text(max_size=20), content_parts, scalars)},
    ),
    max_size=3,
)
values = st.one_of(
    scalars,
    messages,
    content_parts,
    st.lists(st.text(max_size=6), max_size=40),  # long stop / prompt lists
    st.just([]),
    st.integers(1, 60).map(_nested),
    st.dictionaries(st.text(max_size=6), scalars, max_size=3),
)


@st.composite
def json_bodies(draw: st.DrawFn) -> bytes:
    """A valid request with a few fields replaced, dropped or added."""
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 4}
    if draw(st.booleans()):
        body["prompt"] = draw(st.one_of(st.text(max_size=20), st.lists(st.text(max_size=8))))
    else:
        body["messages"] = [{"role": "user", "content": draw(st.text(max_size=20))}]
    for field in draw(st.lists(st.sampled_from(FIELDS), max_size=4)):
        if draw(st.integers(0, 5)) == 0:
            body.pop(field, None)
        else:
            body[field] = draw(values)
    return json.dumps(body, allow_nan=True).encode()  # NaN, Infinity and \ud800 escapes


raw_bodies = st.one_of(
    st.binary(max_size=200),
    st.sampled_from(
        [
            b'{"model": "%s", "prompt": "\xed\xa0\x80"}' % MODEL.encode(),  # UTF-8 of a surrogate
            b'{"model": "%s", "prompt": "\xff\xfe"}' % MODEL.encode(),
            b'{"model": "%s", "prompt": "x", "n": 1%s}' % (MODEL.encode(), b"0" * 5000),
            b'{"model": "%s", "prompt": "x", "stop": %s}'
            % (MODEL.encode(), b"[" * 5000 + b"]" * 5000),
            b"[" * 100000,
            b"",
            b"null",
            b"[]",
        ]
    ),
)
auth_headers = st.sampled_from(
    [f"Bearer {KEY}", f"bearer {KEY}", f"BEARER  {KEY}", "Bearer batch-only", "Bearer no", "", KEY]
)
tier_headers = st.sampled_from([None, "interactive", "standard", "batch", "gold", ""])


def _check_openai_shaped(response: httpx.Response) -> None:
    assert response.status_code in ALLOWED_STATUSES, (response.status_code, response.text)
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.text.splitlines() if line]
        assert events and events[-1] == "[DONE]", events[-3:]
        for event in events[:-1]:
            chunk = json.loads(event)
            assert "choices" in chunk or "error" in chunk
        return
    body = response.json()
    if response.status_code == 200:
        assert body["choices"] and "usage" in body
    else:
        error = body["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert isinstance(error["type"], str) and "param" in error and "code" in error


@settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    body=st.one_of(json_bodies(), raw_bodies),
    authorization=auth_headers,
    tier=tier_headers,
)
def test_every_answer_is_a_documented_status_in_openai_shape(
    base_url: str, path: str, body: bytes, authorization: str, tier: str | None
) -> None:
    headers = {"Content-Type": "application/json", "Authorization": authorization}
    if tier is not None:
        headers["X-SLA-Tier"] = tier
    response = httpx.post(f"{base_url}{path}", content=body, headers=headers, timeout=30)
    _check_openai_shaped(response)


def test_still_serving_after_the_fuzz(base_url: str) -> None:
    assert httpx.get(f"{base_url}/health").status_code == 200
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    headers = {"Authorization": f"Bearer {KEY}"}
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == "abc"


@pytest.mark.parametrize(
    ("field", "value"),
    [("functions", [{"name": "f", "parameters": {}}]), ("unknown_field", 1)],
)
def test_a_field_not_honoured_is_a_400_naming_it_over_http(
    base_url: str, field: str, value: Any
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], field: value}
    headers = {"Authorization": f"Bearer {KEY}"}
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == field
