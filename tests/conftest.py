"""Shared fixtures (fp32 engines on the default model, each configuration loaded once) and
the markers a test's folder gives it: tests/integration/ starts Ray, servers or processes."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerBase
from xdist.scheduler import LoadScopeScheduling

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
    """Mark every test under tests/integration/ `integration`, so `-m` selects by layer."""
    for item in items:
        if item.path.relative_to(TESTS_DIR).parts[0] == "integration":
            item.add_marker(pytest.mark.integration)


class LayerScheduling(LoadScopeScheduling):
    """pytest-xdist's work units for any `-n` run: every unit test is a unit of its own,
    so two workers share the unit tests evenly (their torch uses one thread each, so two
    workers use both cores); the integration tests, where a run includes them, are one
    unit, so one worker runs them in their usual order on the one Ray cluster they share.
    `make test` runs the integration tests in a process of their own all the same."""

    def _split_scope(self, nodeid: str) -> str:
        return "integration" if nodeid.startswith("tests/integration/") else nodeid


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> LayerScheduling:
    return LayerScheduling(config, log)


ENGINES_KEPT = 3
"""Engines `make_engine` keeps alive: each holds its own copy of the model (0.5 GB in fp32),
and the suite asks for some twenty configurations; tests asking for one ask in a row."""


@pytest.fixture(scope="session")
def make_engine() -> Callable[..., LLMEngine]:
    """`make_engine(**overrides)`: an idle fp32 engine, built once per distinct config while
    it is among the ENGINES_KEPT most recently asked for."""
    engines: OrderedDict[EngineConfig, LLMEngine] = OrderedDict()

    def make(**overrides) -> LLMEngine:
        config = EngineConfig(**{**TEST_ENGINE_CONFIG, **overrides})
        if config not in engines:
            engines[config] = LLMEngine(config)
            if len(engines) > ENGINES_KEPT:
                engines.popitem(last=False)
        engines.move_to_end(config)
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
