"""Shared fixtures (fp32 engines on the default model, each configuration loaded once) and
the markers a test's folder gives it: tests/integration/ starts Ray, servers or processes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from engine.config import EngineConfig, default_cache_dir
from engine.engine import LLMEngine
from engine.model.batch_invariance import request_reproducible_blas
from engine.model.loader import load_tokenizer
from small_model.distill.run import distill
from testing.engine_helpers import TEST_ENGINE_CONFIG, tiny_distill_settings

# Before this process's first matmul, as a pool replica does (engine.process).
request_reproducible_blas()

# Two shared cores: extra torch threads only contend with each other (ENVIRONMENT.md).
torch.set_num_threads(1)


TESTS_DIR = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test under tests/integration/ `integration`, so `-m` selects by layer.

    Under pytest-xdist (`make test` runs two workers, `--dist loadgroup`) the integration
    tests form one group: one worker runs them in their usual order, on the one Ray cluster
    they share, while the other takes unit tests, whose torch uses one thread. Tests on the
    tiny distilled student form another group, so only one worker distils it."""
    for item in items:
        if item.path.relative_to(TESTS_DIR).parts[0] == "integration":
            item.add_marker(pytest.mark.integration)
            item.add_marker(pytest.mark.xdist_group("integration"))
        elif "tiny_student_cache" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("student"))


@pytest.fixture(scope="session")
def make_engine() -> Callable[..., LLMEngine]:
    """`make_engine(**overrides)`: an idle fp32 engine, built once per distinct config."""
    engines: dict[EngineConfig, LLMEngine] = {}

    def make(**overrides) -> LLMEngine:
        config = EngineConfig(**{**TEST_ENGINE_CONFIG, **overrides})
        if config not in engines:
            engines[config] = LLMEngine(config)
        engine = engines[config]
        for request_id in list(engine.requests):  # left behind by a failed test
            engine.abort_request(request_id)
        return engine

    return make


@pytest.fixture
def engine(make_engine) -> LLMEngine:
    return make_engine()


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerBase:
    return load_tokenizer("default", default_cache_dir())


@pytest.fixture(scope="session")
def tiny_student_cache(tmp_path_factory) -> Path:
    """A cache holding one student distilled on a tiny budget (2 of 30 layers, 2 steps):
    quality is beside the point, its shape and loading are what tests need."""
    cache = tmp_path_factory.mktemp("student-cache")
    distill(tiny_distill_settings(), cache, show_progress=False)
    return cache

