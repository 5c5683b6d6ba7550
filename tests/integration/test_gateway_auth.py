"""The gateway and request limits through real Ray Serve and HTTP, with the fake engine:
keys from inline / env / file, tiers per key (403), the Bearer scheme in any case, every
route but /health behind a key, body size (413), prompts / n / stop bounds (400), a
request larger than its key's bucket, tier deadlines (408 or an error event), the
catch-all 500, and the per-request line in the ingress replica's log, refusals' included
(with their reason, and counted by it as admission decisions).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from serving.config import RequestLimits
from serving.gateway_config import ApiKeyConfig, GatewayConfig
from serving.http.gateway import Gateway
from testing.fakes import FAIL_MARKER, FakeEngine
from testing.local_cluster import (
    serving,  # a cluster of its own: its workers read a key from the environment
)
from testing.serve_harness import fake_config, metric, request_log, wait_for_metric

MODEL = "SmolLM2-135M-Instruct"
OPEN_KEY = "open-secret"
ENV_KEY = "env-secret"
FILE_KEY = "file-secret"
SMALL_KEY = "small-secret"
KEY_ENV_VAR = "TS_TEST_BATCH_KEY"
BATCH_DEADLINE_S = 1.0
LIMITS = RequestLimits(
    max_body_bytes=4096, max_prompts=4, max_sequences=6, max_stop_strings=2, max_stop_chars=8
)


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    key_file = tmp_path_factory.mktemp("secrets") / "key"
    key_file.write_text(FILE_KEY + "\n")
    gateway = GatewayConfig(
        require_api_key=True,
        api_keys=(
            ApiKeyConfig(name="open", key=OPEN_KEY),
            ApiKeyConfig(
                name="batch-only",
                key_env=KEY_ENV_VAR,
                default_tier="batch",
                allowed_tiers=("batch",),
            ),
            ApiKeyConfig(
                name="chat-app", key_file=str(key_file), allowed_tiers=("interactive", "standard")
            ),
            ApiKeyConfig(name="small", key=SMALL_KEY, tokens_per_minute=100),
        ),
    )
    base = fake_config()
    tiers = tuple(
        t.model_copy(update={"deadline_s": BATCH_DEADLINE_S if t.name == "batch" else 30.0})
        for t in base.tiers
    )
    config = fake_config(gateway=gateway, limits=LIMITS, tiers=tiers)
    # The Ray workers inherit this process's environment: the ingress reads the key there.
    os.environ[KEY_ENV_VAR] = ENV_KEY
    try:
        with serving(config, FakeEngine) as url:
            yield url
    finally:
        del os.environ[KEY_ENV_VAR]


def _post(
    base_url: str,
    body: object,
    key: str | None = OPEN_KEY,
    path: str = "/v1/completions",
    **headers: str,
) -> httpx.Response:
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{base_url}{path}", json=body, headers={**auth, **headers}, timeout=30)


def _completion(**fields: object) -> dict:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **fields}


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_keys_from_env_and_file_authenticate(base_url: str) -> None:
    env = _post(base_url, _completion(), key=ENV_KEY)
    assert env.status_code == 200 and env.headers["x-tierserve-tier"] == "batch"
    file = _post(base_url, _completion(), key=FILE_KEY)
    assert file.status_code == 200 and file.headers["x-tierserve-tier"] == "standard"
    assert _error(_post(base_url, _completion(), key=FILE_KEY + "x"), 401)["code"] == (
        "invalid_api_key"
    )


@pytest.mark.parametrize(
    ("key", "tier"), [(ENV_KEY, "interactive"), (FILE_KEY, "batch"), (ENV_KEY, "standard")]
)
def test_a_key_may_only_use_its_tiers(base_url: str, key: str, tier: str) -> None:
    error = _error(_post(base_url, _completion(), key=key, **{"X-SLA-Tier": tier}), 403)
    assert error["type"] == "permission_error" and error["param"] == "tier"
    assert repr(tier) in error["message"]
    in_body = _post(base_url, _completion(tier=tier), key=key)
    assert _error(in_body, 403)["type"] == "permission_error"


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_bearer_scheme_in_any_case(base_url: str, scheme: str) -> None:
    headers = {"Authorization": f"{scheme} {OPEN_KEY}"}
    response = httpx.post(f"{base_url}/v1/completions", json=_completion(), headers=headers)
    assert response.status_code == 200


def test_only_health_answers_without_a_key(base_url: str) -> None:
    assert httpx.get(f"{base_url}/health").status_code == 200
    for path in ["/metrics", "/v1/models"]:
        assert _error(httpx.get(f"{base_url}{path}"), 401)["code"] == "invalid_api_key"
        basic = httpx.get(f"{base_url}{path}", headers={"Authorization": f"Basic {OPEN_KEY}"})
        assert basic.status_code == 401
        keyed = httpx.get(f"{base_url}{path}", headers={"Authorization": f"Bearer {OPEN_KEY}"})
        assert keyed.status_code == 200
        assert "vllm:num_requests_running" in keyed.text or path == "/v1/models"


def test_a_body_over_the_limit_is_a_413(base_url: str) -> None:
    error = _error(_post(base_url, _completion(prompt="x" * 5000)), 413)
    assert "4096 bytes" in error["message"]


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"prompt": ["a"] * 5}, "prompt", "at most 4"),
        ({"prompt": ["a", "b"], "n": 4}, "n", "8 sequences"),
        ({"n": 7}, "n", "at most 6"),
        ({"stop": ["a", "b", "c"]}, "stop", "at most 2"),
        ({"stop": "abcdefghi"}, "stop", "at most 8 characters"),
        ({"prompt": []}, "prompt", "at least 1"),
    ],
)
def test_requests_over_the_limits_are_400s_naming_the_field(
    base_url: str, fields: dict, param: str, words: str
) -> None:
    error = _error(_post(base_url, _completion(**fields)), 400)
    assert error["param"] == param and words in error["message"]


def test_a_request_larger_than_its_keys_bucket_gets_a_clear_400(base_url: str) -> None:
    # The small key may spend 100 tokens a minute: 2 prompt + 200 completion never fit.
    error = _error(_post(base_url, _completion(max_tokens=200), key=SMALL_KEY), 400)
    assert error["code"] == "request_too_large"
    assert "202 tokens" in error["message"] and "100 tokens per minute" in error["message"]
    assert _post(base_url, _completion(max_tokens=20), key=SMALL_KEY).status_code == 200


def test_past_the_deadline_a_request_is_aborted_with_a_408(base_url: str) -> None:
    body = _completion(max_tokens=2000, user="u-9")  # ten seconds of fake tokens, deadline 1 s
    response = _post(base_url, body, key=ENV_KEY)
    error = _error(response, 408)
    assert error["code"] == "deadline_exceeded" and "1 s" in error["message"]
    fields = request_log(response.headers["x-tierserve-request-id"])
    assert (fields["status"], fields["tier"], fields["user"]) == ("timeout", "batch", "u-9")
    assert fields["placement"] == "slo" and fields["predicted_ttft_ms"] >= 0
    wait_for_metric(
        base_url, "vllm:num_requests_running", 0, timeout_s=3, api_key=OPEN_KEY, pool="offline"
    )


def test_past_the_deadline_a_stream_ends_with_an_error_event(base_url: str) -> None:
    body = _completion(max_tokens=2000, stream=True)
    headers = {"Authorization": f"Bearer {ENV_KEY}"}
    with httpx.stream(
        "POST", f"{base_url}/v1/completions", json=body, headers=headers, timeout=30
    ) as r:
        assert r.status_code == 200
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "deadline_exceeded" and error["type"] == "timeout_error"
    assert len(events) > 3  # tokens came before the deadline
    wait_for_metric(
        base_url, "vllm:num_requests_running", 0, timeout_s=3, api_key=OPEN_KEY, pool="offline"
    )


def test_an_unexpected_fault_is_a_500_json_with_the_request_id(base_url: str) -> None:
    response = _post(base_url, _completion(prompt=f"x{FAIL_MARKER}"))
    error = _error(response, 500)
    assert error["type"] == "server_error"
    assert response.headers["x-tierserve-request-id"] in error["message"]
    assert "internal detail" not in response.text


def test_each_request_writes_one_log_line_to_the_replica_log(base_url: str) -> None:
    response = _post(base_url, _completion(prompt="secret words", max_tokens=3, user="u-42"))
    request_id = response.headers["x-tierserve-request-id"]
    fields = request_log(request_id)
    assert fields["request_id"] == f"cmpl-{request_id}"
    # standard runs on the cheapest pool predicted to meet its SLO
    assert fields["tier"] == "standard" and fields["pool"] == "offline"
    assert fields["model"] == MODEL and fields["status"] == "ok" and fields["user"] == "u-42"
    assert fields["placement"] == "slo" and fields["predicted_ttft_ms"] >= 0
    assert (fields["prompt_tokens"], fields["output_tokens"]) == (len("secret words"), 3)
    assert fields["ttft_ms"] > 0 and fields["latency_ms"] >= fields["ttft_ms"]
    assert "prompt" not in fields and "secret words" not in json.dumps(fields)


def _refusal_log(response: httpx.Response, status: int) -> dict:
    """The refused request's log line, checked to name its status and the refusal."""
    fields = request_log(response.headers["x-tierserve-request-id"])
    assert fields["status"] == "refused" and fields["http_status"] == status
    assert fields["pool"] is None and fields["message"] == response.json()["error"]["message"]
    return fields


def _admissions(base_url: str) -> dict[tuple[str, str, str], float]:
    """tierserve:admission_decisions_total by (tier, reason, pool)."""
    text = httpx.get(f"{base_url}/metrics", headers={"Authorization": f"Bearer {OPEN_KEY}"}).text
    counts = {}
    for line in text.splitlines():
        if line.startswith("tierserve:admission_decisions_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            counts[labels["tier"], labels["reason"], labels["pool"]] = float(line.split()[-1])
    return counts


def test_a_rate_limited_request_is_logged_and_counted_by_reason_not_admitted(
    base_url: str,
) -> None:
    # The small key may spend 100 tokens a minute: a second 62-token request waits.
    responses, counted = [], {}
    while not responses or responses[-1].status_code == 200:
        assert len(responses) < 3, [r.status_code for r in responses]
        before = _admissions(base_url)
        responses.append(_post(base_url, _completion(max_tokens=60, user="u-7"), key=SMALL_KEY))
        counted = {k: v - before.get(k, 0) for k, v in _admissions(base_url).items()}
    assert _error(responses[-1], 429)["type"] == "rate_limit_exceeded"
    assert {k: v for k, v in counted.items() if v} == {("standard", "rate_limited", "none"): 1}
    fields = _refusal_log(responses[-1], 429)
    assert (fields["reason"], fields["tier"]) == ("rate_limited", "standard")
    assert fields["key"] == "small" and fields["user"] == "u-7" and fields["retry_after_s"] > 0
    assert fields["placement"] == "slo" and fields["predicted_ttft_ms"] >= 0  # placement ran


def test_refusals_before_placement_are_logged_with_their_reason(base_url: str) -> None:
    too_large = _refusal_log(_post(base_url, _completion(prompt="x" * 5000)), 413)
    assert (too_large["reason"], too_large["tier"]) == ("request_too_large", None)
    over_limits = _refusal_log(_post(base_url, _completion(n=7, user="u-8")), 400)
    assert (over_limits["reason"], over_limits["user"]) == ("invalid_request_error", "u-8")
    assert "predicted_ttft_ms" not in over_limits
    assert metric(base_url, "tierserve:admission_decisions_total", OPEN_KEY,
                  tier="none", reason="request_too_large", pool="none") >= 1  # fmt: skip


def test_a_key_file_is_read_at_start_not_per_request(tmp_path: Path) -> None:
    """A key's source is read once: the digest is what the gateway keeps."""
    key_file = tmp_path / "key"
    key_file.write_text("rotating")
    config = ApiKeyConfig(name="k", key_file=str(key_file))
    gateway = Gateway(GatewayConfig(require_api_key=True, api_keys=(config,)))
    key_file.write_text("changed")
    assert gateway.authenticate("Bearer rotating").name == "k"
