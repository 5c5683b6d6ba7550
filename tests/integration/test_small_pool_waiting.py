"""Before its student exists the small pool waits: the app serves everything else, /health
says why, requests naming the small model get a 503; once a student is published in the
cache, the pool loads it and serves (real Ray Serve and HTTP, fake engines)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
from test_small_model_serving import DEFAULT_MODEL, SHORT, SMALL_MODEL, _chat, small_model_config

from engine.model.students import CARD_FILE, students_dir
from testing.fakes import FakeEngine
from testing.serve_harness import serving


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

        folder = students_dir(cache) / "student-v1"  # what `tierserve distill` publishes
        folder.mkdir(parents=True)
        (folder / CARD_FILE).write_text(json.dumps({"name": "student-v1"}))
        _wait_until(lambda: "unavailable" not in httpx.get(f"{url}/health").json())
        assert _chat(url, SMALL_MODEL, SHORT).headers["x-tierserve-pool"] == "small"


def _wait_until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)
