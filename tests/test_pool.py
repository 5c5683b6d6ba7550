"""The pool deployment's class, without Ray: health checks and load reports over a fake engine."""

from __future__ import annotations

import pytest
from fakes import FakeEngine

from deployments.pool import Pool
from engine.config import EngineConfig


@pytest.fixture
def pool() -> Pool:
    return Pool.func_or_class(EngineConfig(), FakeEngine)


def test_check_health_passes_while_the_engine_loop_runs(pool: Pool) -> None:
    pool.check_health()


def test_check_health_fails_when_the_engine_loop_is_dead(pool: Pool) -> None:
    pool._engine.alive = False
    with pytest.raises(RuntimeError, match="not running"):
        pool.check_health()


def test_routing_and_autoscaling_stats_report_the_engine_load(pool: Pool) -> None:
    expected = {"num_waiting": 0, "num_running": 0, "kv_cache_usage": 0.0}
    assert pool.record_routing_stats() == {**expected, "max_num_seqs": EngineConfig().max_num_seqs}
    assert pool.record_autoscaling_stats() == expected
