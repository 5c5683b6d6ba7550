"""The pool monitor: when a pool has no live replica the others are still polled; what
replicas measure (grammar masks, KV capacity) reaches the latency model."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time

import pytest

from engine.config import EngineConfig
from engine.outputs import EngineStats
from engine.sampling_params import SamplingParams
from policies.pool_state import PoolState
from serving.config import PoolConfig
from serving.pools.pool_monitor import (
    TYPICAL_OUTPUT_TOKENS,
    PoolMonitor,
    SentSequence,
)
from testing.fakes import FakeEngine, FakePoolHandle, QueueingFakeEngine

POLL_INTERVAL_S = 0.05
POOLS = {name: PoolConfig(name=name, model_name="m") for name in ("up", "down")}


def test_the_replicas_measured_grammar_mask_reaches_the_step_cost() -> None:
    """Placement prices a constrained request's mask at what its pool's replicas measured."""
    handle = FakePoolHandle(FakeEngine(EngineConfig()), grammar_mask_s=0.0004)
    monitor = PoolMonitor({"up": POOLS["up"]}, {"up": handle}, POLL_INTERVAL_S)
    asyncio.run(monitor.poll_once())
    assert monitor.state("up").cost.per_constrained_row_s == 0.0004


def test_the_replicas_speculation_reaches_the_latency_model() -> None:
    """A speculating pool's decodes compute their drafts and gain what was accepted: 10
    drafts of 4 tokens over 20 decodes, 30 of their tokens accepted, is 3 tokens computed
    and 2.5 gained per decode; a pool that does not speculate computes and gains 1."""
    engine = FakeEngine(EngineConfig())
    monitor = PoolMonitor({"up": POOLS["up"]}, {"up": FakePoolHandle(engine)}, POLL_INTERVAL_S)
    asyncio.run(monitor.poll_once())
    plain = monitor.state("up")
    assert (plain.tokens_computed_per_decode, plain.tokens_gained_per_decode) == (1.0, 1.0)
    engine.spec_accepted_per_pos = [10, 10, 0, 10]
    asyncio.run(monitor.poll_once())
    drafting = monitor.state("up")
    assert (drafting.tokens_computed_per_decode, drafting.tokens_gained_per_decode) == (3.0, 2.5)


def test_the_replicas_prefix_cache_reaches_the_latency_model() -> None:
    """A prompt whose blocks a replica holds is not computed again: after the same 64-token
    prompt twice (its four blocks cached the second time), placement expects a replica to
    compute half of the prompt tokens it is sent; before any prompt, all of them."""
    engine = QueueingFakeEngine(EngineConfig())
    monitor = PoolMonitor({"up": POOLS["up"]}, {"up": FakePoolHandle(engine)}, POLL_INTERVAL_S)
    asyncio.run(monitor.poll_once())
    assert monitor.state("up").prompt_share_computed == 1.0

    async def twice() -> None:
        params = SamplingParams(max_tokens=1)
        for i in range(2):
            async for _ in engine.generate(list(range(64)), params, f"r{i}"):
                pass

    asyncio.run(twice())
    asyncio.run(monitor.poll_once())
    assert monitor.state("up").prompt_share_computed == 0.5


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


def test_a_replica_counts_while_serve_runs_it_however_long_its_silence(monkeypatch) -> None:
    """A loaded machine can delay every replica's answer for seconds: the pool still serves
    (counted out by its silence, it was refused with 503s). It is counted gone when Serve
    stops running it, and the replica Serve runs instead counts once heard from."""
    running = {"up": 1}
    engine = FakeEngine(EngineConfig())
    monitor = PoolMonitor(
        {"up": POOLS["up"]}, {"up": FakePoolHandle(engine)}, 1.0, lambda: dict(running)
    )
    asyncio.run(monitor.poll_once())
    polled_s = time.monotonic()
    monkeypatch.setattr(time, "monotonic", lambda: polled_s + 600.0)  # ten minutes of silence
    assert monitor.state("up").num_replicas == 1
    running["up"] = 0  # Serve lost it (its node, say)
    asyncio.run(monitor.poll_once())  # its stats still answer here: only Serve's word counts
    assert monitor.state("up").num_replicas == 0
    running["up"] = 1
    asyncio.run(monitor.poll_once())
    assert monitor.state("up").num_replicas == 1


class CacheBoundEngine(FakeEngine):
    """The fake engine with a KV cache of a given size, as a real replica reports it."""

    num_kv_blocks = 0

    def stats(self) -> EngineStats:
        return dataclasses.replace(super().stats(), num_kv_blocks=self.num_kv_blocks)


@pytest.mark.parametrize("num_kv_blocks", [0, 20, 10_000])
def test_placement_sees_as_many_slots_as_the_kv_cache_holds(num_kv_blocks: int) -> None:
    """A replica runs max_num_seqs sequences, or as many of the pool's typical size as its
    cache holds when that is fewer (a quantized cache holds more blocks)."""
    engine = CacheBoundEngine(EngineConfig())
    engine.num_kv_blocks = num_kv_blocks
    monitor = PoolMonitor({"up": POOLS["up"]}, {"up": FakePoolHandle(engine)}, POLL_INTERVAL_S)
    asyncio.run(monitor.poll_once())
    config = POOLS["up"].engine
    per_sequence = -(-TYPICAL_OUTPUT_TOKENS // config.block_size)
    fitting = num_kv_blocks // per_sequence if num_kv_blocks else config.max_num_seqs
    assert monitor.state("up").max_num_seqs == min(config.max_num_seqs, fitting)


def test_sequences_in_flight_carry_their_time_per_token_target() -> None:
    """Placement reads the targets of the sequences a pool decodes: while one decodes, the
    engine keeps each step within it (policies.latency.step_in_progress_s)."""
    monitor = PoolMonitor({"up": POOLS["up"]}, {"up": FakePoolHandle(None)}, POLL_INTERVAL_S)
    targeted = SentSequence(1, 100, 64, tpot_target_s=0.06, num_output_tokens=3)
    downgraded = SentSequence(1, 100, 64)
    with monitor.track("up", [targeted, downgraded]):
        in_flight = monitor.state("up").in_flight
    assert [(s.tpot_target_s, s.prefilled) for s in in_flight] == [(0.06, True), (None, False)]
    assert monitor.state("up").in_flight == ()


def test_the_typical_output_length_is_the_mean_of_the_first_sequences_then_recent_ones() -> None:
    """The prior output length is forgotten with the first finished sequence (a pool serving
    32-token answers is not priced at 128 for its first few dozen); later ones weigh
    OUTPUT_EWMA each, so the length follows what the pool serves now."""
    monitor = PoolMonitor({"up": POOLS["up"]}, {"up": FakePoolHandle(None)}, POLL_INTERVAL_S)

    def finish(num_output_tokens: int) -> None:
        with monitor.track("up", [SentSequence(1, 10, 256, num_output_tokens=num_output_tokens)]):
            pass

    probe = SentSequence(1, 10, 256)

    def expected_left() -> int:
        return monitor.state("up").in_flight[0].num_remaining_tokens

    with monitor.track("up", [probe]):
        finish(30)
        assert expected_left() == 30
        finish(50)
        assert expected_left() == 40
        for _ in range(100):
            finish(200)
        assert expected_left() == 200


def test_the_replicas_prompt_rate_reaches_the_latency_model() -> None:
    """Placement stretches a decode step by the prompts the replicas compute, at their
    mean rate (0 before a poll)."""
    engine = FakeEngine(EngineConfig())
    monitor = PoolMonitor({"up": POOLS["up"]}, {"up": FakePoolHandle(engine)}, POLL_INTERVAL_S)
    assert monitor.state("up").prompt_tokens_per_s == 0.0
    engine.prompt_tokens_computed_per_s = 250.0
    asyncio.run(monitor.poll_once())
    assert monitor.state("up").prompt_tokens_per_s == 250.0
