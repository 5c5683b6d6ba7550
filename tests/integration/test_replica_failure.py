"""A pool replica killed mid-request, through real Ray Serve and HTTP: a stream ends with an
error event and `[DONE]`, a non-streaming request gets a 503 in OpenAI's format, nothing
hangs, and once Serve has replaced the replica requests succeed again.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from testing.fakes import SlowFakeEngine
from testing.local_cluster import kill_replica
from testing.serve_harness import fake_config, serving, wait_for_metric

MODEL = "SmolLM2-135M-Instruct"
BODY = {"model": MODEL, "prompt": "x", "max_tokens": 400}  # 20 s at 50 ms a token
HEADERS = {"X-SLA-Tier": "interactive"}
RECOVERY_TIMEOUT_S = 90.0


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with serving(fake_config(), SlowFakeEngine) as url:
        yield url


def test_a_dying_replica_ends_streams_and_requests_cleanly(base_url: str) -> None:
    answers: dict[str, httpx.Response] = {}

    def non_streaming() -> None:
        answers["plain"] = httpx.post(
            f"{base_url}/v1/completions", json=BODY, headers=HEADERS, timeout=60
        )

    plain = threading.Thread(target=non_streaming)
    plain.start()
    body = {**BODY, "stream": True}
    with httpx.stream(
        "POST", f"{base_url}/v1/completions", json=body, headers=HEADERS, timeout=60
    ) as stream:
        lines = stream.iter_lines()
        first = next(lines)
        assert json.loads(first.removeprefix("data: "))["choices"]
        wait_for_metric(base_url, "vllm:num_requests_running", 2, timeout_s=30, pool="interactive")
        kill_replica("pool-interactive")
        events = [line.removeprefix("data: ") for line in lines if line]
    plain.join(timeout=60)
    assert not plain.is_alive()

    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "replica_unavailable" and error["type"] == "server_error"
    response = answers["plain"]
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "replica_unavailable"
    assert int(response.headers["retry-after"]) >= 1


def test_requests_succeed_again_once_serve_replaces_the_replica(base_url: str) -> None:
    body = {**BODY, "max_tokens": 2}
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    statuses = []
    while time.monotonic() < deadline:
        response = httpx.post(f"{base_url}/v1/completions", json=body, headers=HEADERS, timeout=30)
        statuses.append(response.status_code)
        assert "error" in response.json() or response.status_code == 200
        if response.status_code == 200:
            assert response.json()["choices"][0]["text"] == "ab"
            return
        time.sleep(0.5)
    pytest.fail(f"no success within {RECOVERY_TIMEOUT_S} s; statuses {sorted(set(statuses))}")
