"""The pool monitor: when a pool has no live replica the others are still polled; what
replicas measure reaches the latency model."""

from __future__ import annotations

import asyncio
import contextlib

from engine.config import EngineConfig
from policies.latency import PoolState
from serving.config import PoolConfig
from serving.pools.pool_monitor import PoolMonitor
from testing.fakes import FakeEngine, FakePoolHandle

POLL_INTERVAL_S = 0.05
POOLS = {name: PoolConfig(name=name, model_name="m") for name in ("up", "down")}


def test_the_replicas_measured_grammar_mask_reaches_the_step_cost() -> None:
    """Placement prices a constrained request's mask at what its pool's replicas measured."""
    handle = FakePoolHandle(FakeEngine(EngineConfig()), grammar_mask_s=0.0004)
    monitor = PoolMonitor({"up": POOLS["up"]}, {"up": handle}, POLL_INTERVAL_S)
    asyncio.run(monitor.poll_once())
    assert monitor.state("up").cost.per_constrained_row_s == 0.0004


def test_a_pool_without_replicas_does_not_hold_the_poll_of_the_others() -> None:
    up = FakePoolHandle(FakeEngine(EngineConfig(max_model_len=512)))
    down = FakePoolHandle(None)  # its calls are never answered, as with no replica to run them
    monitor = PoolMonitor(POOLS, {"up": up, "down": down}, POLL_INTERVAL_S)

    async def watch() -> dict[str, PoolState]:
        poller = asyncio.create_task(monitor.poll_forever())
        await asyncio.sleep(20 * POLL_INTERVAL_S)
        states = monitor.states()
        poller.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await poller
        return states

    states = asyncio.run(watch())
    assert states["up"].num_replicas == 1
    assert monitor.max_model_len("up") == 512
    assert states["down"].num_replicas == 0
    # Each unanswered call was given up and cancelled, not left to pile up in Serve.
    assert len(down.calls) >= 2 and all(call.cancelled() for call in down.calls)
    assert len(up.calls) > len(down.calls)
