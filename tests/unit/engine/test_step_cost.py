"""The online step-cost fit the latency predictions read."""

from __future__ import annotations

import random
import statistics
import time

import pytest

from engine.engine import CALIBRATION_STEPS
from engine.step_cost import StepCostModel
from testing.engine_helpers import drain, greedy


def test_fit_recovers_a_known_cost_line():
    model, rng = StepCostModel(), random.Random(0)
    for _ in range(400):
        num_seqs = rng.randint(1, 64)
        num_tokens = num_seqs + rng.choice([0, 0, 128, 256])
        model.observe(num_seqs, num_tokens, 0.03 + 0.004 * num_seqs + 0.0012 * num_tokens)
    assert model.coefficients() == pytest.approx((0.03, 0.004, 0.0012), rel=0.02)


def test_fit_recovers_the_attention_term_and_folds_it_into_the_token_cost():
    model, rng = StepCostModel(), random.Random(2)
    for _ in range(400):
        num_seqs = rng.randint(1, 64)
        chunk = rng.choice([0, 0, 128, 256])
        context = rng.randint(1, 2000)
        attended = num_seqs * context + chunk * (context + chunk)
        seconds = 0.03 + 0.004 * num_seqs + 0.0012 * (num_seqs + chunk) + 2e-7 * attended
        model.observe(num_seqs, num_seqs + chunk, seconds, attended)
    assert model.step_s(8, 100, 50_000) == pytest.approx(
        0.03 + 0.004 * 8 + 0.0012 * 100 + 2e-7 * 50_000, rel=0.02
    )
    assert model.tokens_in(0.1, context=1000) < model.tokens_in(0.1, context=0)
    base, per_seq, per_token = model.coefficients()
    assert (base, per_seq) == pytest.approx((0.03, 0.004), rel=0.05)
    assert per_token > 0.0012  # a token's cost at the recent contexts includes its attention


def test_decode_only_load_keeps_predicting_right_and_stays_finite():
    """Decode steps tie tokens to sequences: the split is unknowable, the sum must hold."""
    model, rng = StepCostModel(), random.Random(1)
    for _ in range(5_000):
        n = rng.randint(1, 64)
        model.observe(n, n, 0.02 + 0.005 * n)
    base, per_seq, per_token = model.coefficients()
    assert base + 32 * (per_seq + per_token) == pytest.approx(0.02 + 0.005 * 32, rel=0.01)


def test_engine_reports_its_fitted_step_cost(engine):
    engine.add_request("a", list(range(1, 60)), greedy(8, ignore_eos=True))
    drain(engine)
    stats = engine.stats()
    assert engine.step_cost.num_observations >= 8
    assert sum(stats.step_cost) > 0
    assert stats.max_num_seqs == engine.config.max_num_seqs


def test_start_up_calibration_fits_this_machine_and_leaves_no_trace(make_engine):
    engine = make_engine(calibrate_step_cost=True)
    assert engine.step_cost.num_observations >= 3 * CALIBRATION_STEPS
    stats = engine.stats()
    assert not engine.has_unfinished() and stats.kv_cache_usage == 0
    counters = (stats.num_prompt_tokens, stats.num_generation_tokens, stats.prefix_cache_queries)
    assert counters == (0, 0, 0)
    predicted_s = sum(engine.step_cost.coefficients()[:2]) + engine.step_cost.coefficients()[2]
    engine.add_request("probe", list(range(1, 9)), greedy(6, ignore_eos=True))
    step_s = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        step_s.append(time.perf_counter() - start)
    measured_s = statistics.median(step_s[1:])  # the decodes of one sequence alone
    assert measured_s / 3 < predicted_s < measured_s * 3
