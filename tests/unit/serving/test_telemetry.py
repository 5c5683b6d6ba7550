"""Telemetry without Ray: engine stats polled through a fake handle, rendered under vLLM's names."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest

from engine.config import EngineConfig
from engine.outputs import FirstTokenTimes, RequestOutput
from policies.latency import Prediction
from policies.placement import Placement
from policies.tiers import Tier
from serving.config import PoolConfig
from serving.gateway_config import CallerPolicy
from serving.http.errors import ApiError, payload_too_large, too_many_requests
from serving.http.routes import Call
from serving.http.schemas.responses import Usage
from serving.http.streaming import SequenceProgress
from serving.pools.pool_monitor import PoolMonitor
from serving.telemetry import Admission, RequestRecord, Telemetry, request_log
from testing.fakes import FakeEngine, FakePoolHandle

POOLS = {"fast": PoolConfig(name="fast", model_name="m")}
TIER = Tier(name="standard", ttft_ms=2000, tpot_ms=60, priority=1, pool="fast")
CALL = Call("r1", start_s=0.0, caller=CallerPolicy(name="k"))


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
    choice = SequenceProgress(start_s=0.0, prompt_index=0)
    for i, queue_time_s in enumerate([0.3, 0.3]):
        output = RequestOutput("r", [i], "x", finished=i == 1, queue_time_s=queue_time_s)
        choice.add(output, now_s=1.0 + i)
    tier = Tier(name="standard", ttft_ms=2000, tpot_ms=60, priority=1, pool="fast")
    telemetry.observe(RequestRecord("r", "k", tier, "fast", "ok", [choice], end_s=2.0))
    labels = (("model_name", "m"), ("pool", "fast"), ("tier", "standard"))
    assert _samples(telemetry, "vllm:request_queue_time_seconds_count") == {labels: 1}
    assert _samples(telemetry, "vllm:request_queue_time_seconds_sum") == {labels: 0.3}


def _log_lines(caplog: pytest.LogCaptureFixture) -> list[dict]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == request_log.name]


def _refused(caplog: pytest.LogCaptureFixture, admission: Admission, error: ApiError) -> dict:
    """The log line and admission count of `error` refusing `admission`."""
    telemetry = _telemetry(FakeEngine(EngineConfig()))
    level = caplog.at_level(logging.INFO, logger=request_log.name)
    with level, pytest.raises(ApiError), telemetry.refusals(admission):
        raise error
    (line,) = _log_lines(caplog)
    decisions = _samples(telemetry, "tierserve:admission_decisions_total")
    tier = admission.tier or "none"
    assert decisions == {(("pool", "none"), ("reason", error.reason), ("tier", tier)): 1}
    return line


def test_a_shed_request_is_logged_with_its_reason_and_prediction(
    caplog: pytest.LogCaptureFixture,
) -> None:
    prediction = Prediction(ttft_s=1.5, tpot_s=0.04, num_ahead=9, slot_wait_s=0.6, prefill_s=0.7)
    placement = Placement(None, "shed_slo", prediction, 2)
    admission = Admission(CALL, user="end-user-7", tier="standard", placement=placement)
    line = _refused(caplog, admission, too_many_requests("over capacity", 2, "shed_slo"))
    assert line.pop("latency_ms") >= 0
    assert line == {
        "request_id": "r1", "key": "k", "tier": "standard", "pool": None, "status": "refused",
        "http_status": 429, "reason": "shed_slo", "message": "over capacity",
        "retry_after_s": 2, "user": "end-user-7",
        "placement": "shed_slo", "predicted_ttft_ms": 1500.0, "predicted_tpot_ms": 40.0,
        "predicted_ttft_parts_ms": {
            "step_in_progress": 200.0, "slot_wait": 600.0, "prefill": 700.0,
        },
    }  # fmt: skip


def test_a_request_refused_before_it_has_a_tier_is_counted_under_tier_none(
    caplog: pytest.LogCaptureFixture,
) -> None:
    line = _refused(caplog, Admission(CALL), payload_too_large(4096))
    assert (line["http_status"], line["reason"], line["tier"]) == (413, "request_too_large", None)
    assert "user" not in line and "predicted_ttft_ms" not in line


def test_an_admitted_request_logs_its_user_and_every_pools_prediction(
    caplog: pytest.LogCaptureFixture,
) -> None:
    telemetry = _telemetry(FakeEngine(EngineConfig()))
    chosen = Prediction(ttft_s=0.2, tpot_s=0.02, num_ahead=0)
    passed_over = Prediction(ttft_s=0.9, tpot_s=0.03, num_ahead=2)
    placement = Placement("fast", "slo", chosen, candidates={"fast": chosen, "own": passed_over})
    telemetry.count_admitted("standard", placement)
    record = RequestRecord(
        "r", "k", TIER, "fast", "ok", [], end_s=1.0, user="u", placement=placement
    )
    with caplog.at_level(logging.INFO, logger=request_log.name):
        telemetry.observe(record)
    (line,) = _log_lines(caplog)
    assert (line["user"], line["placement"], line["predicted_ttft_ms"]) == ("u", "slo", 200.0)
    assert line["predictions_ms"] == {"fast": [200.0, 20.0, 0], "own": [900.0, 30.0, 2]}
    decisions = _samples(telemetry, "tierserve:admission_decisions_total")
    assert decisions == {(("pool", "fast"), ("reason", "slo"), ("tier", "standard")): 1}


def test_a_completed_request_measures_its_prediction() -> None:
    telemetry = _telemetry(FakeEngine(EngineConfig()))
    choice = SequenceProgress(start_s=0.0, prompt_index=0)
    for i in range(3):  # first token at 0.8 s, then one every 50 ms
        choice.add(RequestOutput("r", [i], "x", finished=i == 2), now_s=0.8 + 0.05 * i)
    placement = Placement("fast", "slo", Prediction(ttft_s=0.2, tpot_s=0.05, num_ahead=0))
    telemetry.observe(
        RequestRecord("r", "k", TIER, "fast", "ok", [choice], end_s=0.9, placement=placement)
    )
    error_sums = _samples(telemetry, "tierserve:prediction_error_ms_sum")
    assert error_sums[(("metric", "ttft"), ("pool", "fast"))] == pytest.approx(600.0)
    assert error_sums[(("metric", "tpot"), ("pool", "fast"))] == pytest.approx(0.0, abs=1e-6)


def test_the_log_line_splits_the_first_token_into_engine_queue_and_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """queue_ms (waiting in the engine) beside ttft_ms says where a late first token waited."""
    telemetry = _telemetry(FakeEngine(EngineConfig()))
    choice = SequenceProgress(start_s=0.0, prompt_index=0)
    first = RequestOutput("r", [1], "x", finished=True, queue_time_s=0.3)
    choice.add(first, now_s=0.5)
    with caplog.at_level(logging.INFO, logger=request_log.name):
        telemetry.observe(RequestRecord("r", "k", TIER, "fast", "ok", [choice], end_s=0.5))
    (line,) = _log_lines(caplog)
    assert (line["queue_ms"], line["ttft_ms"]) == (300.0, 500.0)


def test_the_log_line_places_the_first_token_hop_by_hop(caplog: pytest.LogCaptureFixture) -> None:
    """ttft_hops_ms: the engine's and its front's instants against the ingress's own; the
    hops add up to the time to first token."""
    telemetry = _telemetry(FakeEngine(EngineConfig()))
    start_s = time.monotonic()
    start_wall = time.time() - (time.monotonic() - start_s)
    choice = SequenceProgress(start_s=start_s, prompt_index=0)
    instants = [start_wall + offset for offset in (0.1, 0.3, 0.35, 1.35, 1.4)]
    times = FirstTokenTimes(*instants)
    choice.add(RequestOutput("r", [1], "x", finished=True, first_token_times=times), start_s + 1.5)
    with caplog.at_level(logging.INFO, logger=request_log.name):
        telemetry.observe(RequestRecord("r", "k", TIER, "fast", "ok", [choice], end_s=start_s + 2))
    (line,) = _log_lines(caplog)
    hops = line["ttft_hops_ms"]
    expected = {"to_pool": 100, "to_engine": 200, "engine_queue": 50, "to_first_token": 1000}
    expected |= {"to_pool_back": 50, "to_ingress_back": 100}
    assert hops == pytest.approx(expected, abs=2)
    assert sum(hops.values()) == pytest.approx(line["ttft_ms"], abs=2)


def test_a_cache_hit_logs_the_usage_it_answered_with_and_counts_no_tokens(
    caplog: pytest.LogCaptureFixture,
) -> None:
    telemetry = _telemetry(FakeEngine(EngineConfig()))
    hit = SequenceProgress(start_s=0.0, prompt_index=0)  # nothing generated: a replay
    replayed = Usage(prompt_tokens=37, completion_tokens=8, total_tokens=45)
    record = RequestRecord("r", "k", TIER, "fast", "cache_hit", [hit], 0.004, replayed=replayed)
    with caplog.at_level(logging.INFO, logger=request_log.name):
        telemetry.observe(record)
    (line,) = _log_lines(caplog)
    assert (line["status"], line["prompt_tokens"], line["output_tokens"]) == ("cache_hit", 37, 8)
    generated = _samples(telemetry, "vllm:generation_tokens_total")
    prompts = _samples(telemetry, "vllm:prompt_tokens_total")
    assert set(generated.values()) == {0} and set(prompts.values()) == {0}
