"""The small model through real Ray Serve and HTTP, with fake engines: `model: auto` sends
easy requests of routed tiers to it, by the router beside the student it serves, and named
models are pinned. The helpers here serve tests/integration/test_small_pool_waiting.py too."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import openai
import pytest

from policies.difficulty import FEATURE_NAMES, DifficultyModel, StudentIdentity
from serving.app_config import TierserveConfig
from serving.config import SmallModelConfig
from testing.fakes import FakeEngine, publish_fake_student
from testing.serve_harness import fake_config, metric, serving

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
SMALL_MODEL = "SmolLM2-student"
SHORT = "hi"
LONG = "Explain, step by step, why " + "the sky and the sea look blue " * 8
STUDENT_DIGEST = "5" * 64


def length_router(student: StudentIdentity | None = None) -> DifficultyModel:
    """A router that finds prompts under ~50 tokens easy (the fake tokenizer: a token per
    character), whatever else they say, fitted to `student`."""
    weights = [-1.0 if name == "log_prompt_tokens" else 0.0 for name in FEATURE_NAMES]
    return DifficultyModel(
        feature_names=FEATURE_NAMES,
        weights=tuple(weights),
        bias=4.0,
        means=(0.0,) * len(FEATURE_NAMES),
        scales=(1.0,) * len(FEATURE_NAMES),
        threshold=0.5,
        target_share=0.5,
        student=student,
    )


def small_model_config(tmp_path: Path, student_cache: Path | None = None) -> TierserveConfig:
    """configs/local.yaml for fake engines, its configured router a length router fitted to
    no recorded student (refused for any); with `student_cache`, the small pool runs
    `model: student` from that cache (a fake engine needs a student folder there too)."""
    router_file = tmp_path / "router.json"
    length_router().save(router_file)
    config = fake_config(small_model=SmallModelConfig(pool="small", router_file=router_file))
    if student_cache is None:
        return config
    pools = tuple(
        p.model_copy(update={"engine": replace(p.engine, model="student", cache_dir=student_cache)})
        if p.name == "small"
        else p
        for p in config.pools
    )
    return config.model_copy(update={"pools": pools})


@pytest.fixture(scope="module")
def base_url(tmp_path_factory) -> Iterator[str]:
    """The small pool serves a student published with the router fitted to it."""
    tmp_path = tmp_path_factory.mktemp("router")
    student = StudentIdentity("student-v1", STUDENT_DIGEST)
    publish_fake_student(tmp_path / "cache", student.name, STUDENT_DIGEST, length_router(student))
    with serving(small_model_config(tmp_path, tmp_path / "cache"), FakeEngine) as url:
        yield url


def _chat(base_url: str, model: str, text: str, tier: str = "standard") -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 3}
    return httpx.post(
        f"{base_url}/v1/chat/completions", json=body, headers={"X-SLA-Tier": tier}, timeout=30
    )


def test_auto_routes_easy_requests_of_routed_tiers_to_the_small_model(base_url: str) -> None:
    easy = _chat(base_url, "auto", SHORT)
    assert easy.status_code == 200, easy.text
    assert easy.headers["x-tierserve-model"] == SMALL_MODEL
    assert easy.headers["x-tierserve-pool"] == "small"
    assert float(easy.headers["x-tierserve-difficulty"]) < 0.5
    assert easy.json()["model"] == SMALL_MODEL

    hard = _chat(base_url, "auto", LONG)
    assert hard.headers["x-tierserve-model"] == DEFAULT_MODEL
    assert hard.headers["x-tierserve-pool"] in ("interactive", "offline")  # standard's pools
    assert float(hard.headers["x-tierserve-difficulty"]) > 0.5

    interactive = _chat(base_url, "auto", SHORT, tier="interactive")  # not routed there
    assert interactive.headers["x-tierserve-model"] == DEFAULT_MODEL
    assert "x-tierserve-difficulty" not in interactive.headers
    batch = _chat(base_url, "auto", SHORT, tier="batch")
    assert batch.headers["x-tierserve-pool"] == "small"
    labels = {"tier": "standard", "model": SMALL_MODEL, "reason": "easy"}
    assert metric(base_url, "tierserve:model_decisions_total", **labels) >= 1
    labels = {"tier": "interactive", "model": DEFAULT_MODEL, "reason": "not_routed"}
    assert metric(base_url, "tierserve:model_decisions_total", **labels) >= 1
    router = httpx.get(f"{base_url}/health").json()["difficulty_router"]
    assert router == {
        "pool": "small",
        "router": "student",
        "student": f"student-v1 (weights {STUDENT_DIGEST[:12]})",
    }


def test_named_models_are_pinned_and_listed(base_url: str) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
    assert [m.id for m in client.models.list()] == [DEFAULT_MODEL, SMALL_MODEL]
    pinned = _chat(base_url, SMALL_MODEL, LONG, tier="interactive")
    assert pinned.headers["x-tierserve-pool"] == "small"
    default = _chat(base_url, DEFAULT_MODEL, SHORT)
    assert default.headers["x-tierserve-model"] == DEFAULT_MODEL
    unknown = _chat(base_url, "gpt-4", SHORT)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
