"""Telemetry without Ray: engine stats polled through a fake handle, rendered under vLLM's names."""

from __future__ import annotations

import asyncio

from fakes import FakeEngine, FakePoolHandle

from deployments.config import PoolConfig
from deployments.pool_monitor import PoolMonitor
from deployments.streaming import ChoiceProgress
from deployments.telemetry import RequestRecord, Telemetry
from engine.config import EngineConfig
from engine.outputs import RequestOutput
from policies.tiers import Tier

POOLS = {"fast": PoolConfig(name="fast", model_name="m")}


def _telemetry(engine: FakeEngine) -> Telemetry:
    monitor = PoolMonitor(POOLS, {"fast": FakePoolHandle(engine)}, poll_interval_s=1.0)
    asyncio.run(monitor.poll_once())
    return Telemetry("m", POOLS, monitor)


def _samples(telemetry: Telemetry, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Every sample called `name`, keyed by its sorted labels."""
    samples = [s for family in telemetry.registry.collect() for s in family.samples]
    return {tuple(sorted(s.labels.items())): s.value for s in samples if s.name == name}


def test_spec_decode_counters_are_labelled_by_pool_and_position() -> None:
    engine = FakeEngine(EngineConfig())
    engine.spec_accepted_per_pos = [9, 6, 2]
    telemetry = _telemetry(engine)
    labels = (("model_name", "m"), ("pool", "fast"))
    assert _samples(telemetry, "vllm:spec_decode_num_drafts_total") == {labels: 10}
    assert _samples(telemetry, "vllm:spec_decode_num_draft_tokens_total") == {labels: 30}
    assert _samples(telemetry, "vllm:spec_decode_num_accepted_tokens_total") == {labels: 17}
    per_pos = _samples(telemetry, "vllm:spec_decode_num_accepted_tokens_per_pos_total")
    assert per_pos == {(*labels, ("position", str(i))): n for i, n in enumerate([9, 6, 2])}


def test_spec_decode_counters_are_zero_without_speculation() -> None:
    telemetry = _telemetry(FakeEngine(EngineConfig()))
    labels = (("model_name", "m"), ("pool", "fast"))
    assert _samples(telemetry, "vllm:spec_decode_num_drafts_total") == {labels: 0}
    assert "vllm:spec_decode_num_accepted_tokens_per_pos" in telemetry.render().decode()


def test_queue_time_comes_from_the_first_output() -> None:
    telemetry = _telemetry(FakeEngine(EngineConfig()))
    choice = ChoiceProgress(start_s=0.0, prompt_index=0)
    for i, queue_time_s in enumerate([0.3, 0.3]):
        output = RequestOutput("r", [i], "x", finished=i == 1, queue_time_s=queue_time_s)
        choice.add(output, now_s=1.0 + i)
    tier = Tier(name="standard", ttft_ms=2000, tpot_ms=60, priority=1, pool="fast")
    telemetry.observe(RequestRecord("r", "k", tier, "fast", "ok", [choice], end_s=2.0))
    labels = (("model_name", "m"), ("pool", "fast"), ("tier", "standard"))
    assert _samples(telemetry, "vllm:request_queue_time_seconds_count") == {labels: 1}
    assert _samples(telemetry, "vllm:request_queue_time_seconds_sum") == {labels: 0.3}
