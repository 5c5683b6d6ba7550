"""Predictions corrected by measurement: factors learned per pool, priority and metric."""

from __future__ import annotations

import pytest

from policies.latency import InFlight, PoolState, StepCost, predict
from policies.prediction_feedback import FACTOR_RANGE, Correction, PredictionFeedback

COST = StepCost(base_s=0.02, per_seq_s=0.002, per_token_s=0.0005)
INTERACTIVE, BATCH = 0, 2


def _pool(feedback: PredictionFeedback, name: str = "offline") -> PoolState:
    busy = tuple(InFlight(priority=BATCH, num_prompt_tokens=100, num_remaining_tokens=50,
                          prefilled=True) for _ in range(8))  # fmt: skip
    return PoolState(name, 1, 16, 512, COST, busy, corrections=feedback.corrections(name))


def test_a_priority_whose_requests_take_three_times_the_prediction_learns_it() -> None:
    feedback = PredictionFeedback()
    raw = predict(_pool(feedback), BATCH, num_prompt_tokens=200)
    raw_interactive = predict(_pool(feedback), INTERACTIVE, num_prompt_tokens=200)
    for _ in range(100):  # the world: everything outside the engine triples batch TTFTs
        placed = predict(_pool(feedback), BATCH, num_prompt_tokens=200)
        feedback.learn("offline", BATCH, "ttft", placed.ttft_s, 3 * raw.ttft_s)
        feedback.learn("offline", BATCH, "tpot", placed.tpot_s, raw.tpot_s)
    corrected = predict(_pool(feedback), BATCH, num_prompt_tokens=200)
    assert corrected.ttft_s == pytest.approx(3 * raw.ttft_s, rel=0.02)
    assert corrected.tpot_s == pytest.approx(raw.tpot_s, rel=1e-9)
    # Served first, an interactive request on the same pool learnt nothing from them.
    assert predict(_pool(feedback), INTERACTIVE, num_prompt_tokens=200) == raw_interactive
    assert feedback.corrections("interactive") == {}


def test_one_stalled_request_moves_the_factor_only_so_far() -> None:
    feedback = PredictionFeedback()
    feedback.learn("offline", BATCH, "ttft", predicted_s=0.1, measured_s=1000.0)
    assert feedback.corrections("offline")[BATCH].ttft == pytest.approx(2.0**0.1)
    for _ in range(1000):
        feedback.learn("offline", BATCH, "ttft", predicted_s=0.1, measured_s=1000.0)
    assert feedback.corrections("offline")[BATCH].ttft == pytest.approx(FACTOR_RANGE[1])


def test_nothing_is_learnt_from_zeros_and_unknown_metrics_are_refused() -> None:
    feedback = PredictionFeedback()
    feedback.learn("offline", BATCH, "tpot", predicted_s=0.0, measured_s=0.05)
    feedback.learn("offline", BATCH, "tpot", predicted_s=0.05, measured_s=0.0)
    assert feedback.corrections("offline") == {}
    with pytest.raises(ValueError, match="metric"):
        feedback.learn("offline", BATCH, "e2e", 1.0, 2.0)
    assert Correction() == Correction(ttft=1.0, tpot=1.0)
