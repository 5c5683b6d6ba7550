"""SLO feasibility (issue 28 part 4): a tier's SLO against its pools' idle latency, in the
policy (pure) and as the ingress serves it (log, /health details, metric)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from engine.config import EngineConfig
from engine.outputs import EngineStats
from engine.step_cost import StepCostFit
from policies.feasibility import TYPICAL_PROMPT_TOKENS, check_tier, idle_latency_ms
from policies.pool_state import PoolState, StepCost
from policies.tiers import Tier
from serving.config import PoolConfig
from serving.pools.pool_monitor import PoolMonitor
from serving.pools.slo_watch import SloWatch
from testing.fakes import FakeEngine, FakePoolHandle

SLOW = StepCost(base_s=0.045, per_seq_s=0.001, per_token_s=0.0002)
"""A batch-1 decode step of 46.2 ms: the 2-core VM's, past a 25 ms TPOT."""
FAST = StepCost(base_s=0.010, per_seq_s=0.001, per_token_s=0.0002)
INTERACTIVE = Tier(name="interactive", ttft_ms=400, tpot_ms=25, pool="interactive",
                   overflow_pool="offline", on_slo_miss="protect")  # fmt: skip
STANDARD = Tier(name="standard", ttft_ms=2000, tpot_ms=60, priority=1, pool="interactive")


def pool(name: str, cost: StepCost) -> PoolState:
    return PoolState(name, num_replicas=1, max_num_seqs=4, max_num_batched_tokens=256, cost=cost)


def test_idle_latency_is_one_prefill_and_one_batch_1_step() -> None:
    ttft_ms, tpot_ms = idle_latency_ms(pool("interactive", SLOW), INTERACTIVE) or (0, 0)
    assert tpot_ms == pytest.approx(46.2)
    assert ttft_ms == pytest.approx((0.045 + 0.001 + 0.0002 * TYPICAL_PROMPT_TOKENS) * 1000)
    assert idle_latency_ms(pool("interactive", StepCost(0, 0, 0)), INTERACTIVE) is None
    busy = dataclasses.replace(pool("interactive", SLOW), prompt_tokens_per_s=2000.0)
    assert idle_latency_ms(busy, INTERACTIVE) == idle_latency_ms(
        pool("interactive", SLOW), INTERACTIVE
    )


def test_a_tpot_below_the_hardwares_step_is_infeasible_and_said_with_figures() -> None:
    result = check_tier(INTERACTIVE, {"interactive": pool("interactive", SLOW)})
    assert result.known and not result.feasible
    assert "TPOT 25 ms" in result.describe() and "46.2 ms" in result.describe()
    assert check_tier(STANDARD, {"interactive": pool("interactive", SLOW)}).feasible


def test_the_overflow_pool_counts_and_the_best_pool_decides() -> None:
    pools = {"interactive": pool("interactive", SLOW), "offline": pool("offline", FAST)}
    result = check_tier(INTERACTIVE, pools)
    assert result.feasible and result.idle_tpot_ms == pytest.approx(11.2)


def test_before_any_fit_nothing_is_claimed() -> None:
    result = check_tier(INTERACTIVE, {"interactive": pool("interactive", StepCost(0, 0, 0))})
    assert not result.known and result.feasible


class FittedEngine(FakeEngine):
    """The fake engine reporting a fitted step cost, as a calibrated engine does."""

    step_cost = SLOW

    def stats(self) -> EngineStats:
        cost = self.step_cost  # the engine fits these three; replicas measure the mask apart
        fitted = StepCostFit(cost.base_s, cost.per_seq_s, cost.per_token_s)
        return dataclasses.replace(super().stats(), step_cost=fitted)


def test_the_ingress_watch_warns_once_and_exports_the_verdict(caplog) -> None:  # noqa: ANN001
    engine = FittedEngine(EngineConfig())
    pools = {"interactive": PoolConfig(name="interactive", model_name="m")}
    monitor = PoolMonitor(pools, {"interactive": FakePoolHandle(engine)}, 1.0)
    asyncio.run(monitor.poll_once())
    watch = SloWatch([INTERACTIVE, STANDARD], monitor)
    with caplog.at_level(logging.INFO, logger="serving.pools.slo_watch"):
        assert list(watch.infeasible()) == ["interactive"]
        watch.check()
        engine.step_cost = FAST
        asyncio.run(monitor.poll_once())
        assert watch.infeasible() == {}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "interactive" in warnings[0].getMessage()
    assert any("feasible again" in r.getMessage() for r in caplog.records)
    registry = CollectorRegistry()
    registry.register(watch)
    text = generate_latest(registry).decode()
    assert 'tierserve:slo_feasible{tier="interactive"} 1.0' in text
    assert 'tierserve:slo_idle_latency_ms{kind="tpot",tier="interactive"} 11.2' in text
