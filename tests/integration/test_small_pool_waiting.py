"""Before its student exists the small pool waits: the app serves everything else, /health
says why, requests naming the small model get a 503; once a student is published in the
cache, the pool loads it and serves, but a router fitted to no student of its own routes
nothing to it (real Ray Serve and HTTP, fake engines)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
from test_small_model_serving import DEFAULT_MODEL, SHORT, SMALL_MODEL, _chat, small_model_config

from testing.fakes import FakeEngine, publish_fake_student
from testing.serve_harness import metric, serving


def test_small_pool_waits_for_its_student_then_serves(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    with serving(small_model_config(tmp_path, student_cache=cache), FakeEngine) as url:
        health = httpx.get(f"{url}/health")
        assert health.status_code == 200, health.text
        assert "no distilled student" in health.json()["unavailable"]["small"]
        routed = _chat(url, "auto", SHORT)
        assert routed.status_code == 200
        assert routed.headers["x-tierserve-model"] == DEFAULT_MODEL
        pinned = _chat(url, SMALL_MODEL, SHORT)
        assert pinned.status_code == 503 and pinned.json()["error"]["code"] == "model_unavailable"
        assert "no distilled student" in pinned.json()["error"]["message"]

        publish_fake_student(cache, "student-v1", "1" * 64)  # without a router of its own
        _wait_until(lambda: "unavailable" not in httpx.get(f"{url}/health").json())
        assert _chat(url, SMALL_MODEL, SHORT).headers["x-tierserve-pool"] == "small"
        # The configured router records no student: refused, so `auto` stays on the default.
        assert _chat(url, "auto", SHORT).headers["x-tierserve-model"] == DEFAULT_MODEL
        labels = {"tier": "standard", "model": DEFAULT_MODEL, "reason": "no_router"}
        assert metric(url, "tierserve:model_decisions_total", **labels) >= 1
        router = httpx.get(f"{url}/health").json()["difficulty_router"]
        assert router["router"] == "refused" and "student-v1" in router["warning"]


def _wait_until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)
