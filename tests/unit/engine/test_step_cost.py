"""The online step-cost fit the latency predictions read."""

from __future__ import annotations

import csv
import random
import statistics
import time
from pathlib import Path

import pytest

from engine.engine import CALIBRATION_STEPS
from engine.step_cost import StepCostModel, StepWork
from testing.engine_helpers import drain, greedy


def test_fit_recovers_a_known_cost_line():
    model, rng = StepCostModel(), random.Random(0)
    for _ in range(400):
        num_seqs = rng.randint(1, 64)
        num_tokens = num_seqs + rng.choice([0, 0, 128, 256])
        model.observe(StepWork(num_seqs, num_tokens), 0.03 + 0.004 * num_seqs + 0.0012 * num_tokens)
    assert model.coefficients()[:3] == pytest.approx((0.03, 0.004, 0.0012), rel=0.02)


def test_fit_recovers_the_attention_term_and_folds_it_into_the_token_cost():
    model, rng = StepCostModel(), random.Random(2)
    for _ in range(400):
        num_seqs = rng.randint(1, 64)
        chunk = rng.choice([0, 0, 128, 256])
        context = rng.randint(1, 2000)
        attended = num_seqs * context + chunk * (context + chunk)
        seconds = 0.03 + 0.004 * num_seqs + 0.0012 * (num_seqs + chunk) + 2e-7 * attended
        model.observe(StepWork(num_seqs, num_seqs + chunk, attended), seconds)
    assert model.step_s(8, 100, 50_000) == pytest.approx(
        0.03 + 0.004 * 8 + 0.0012 * 100 + 2e-7 * 50_000, rel=0.02
    )
    assert model.tokens_in(0.1, context=1000) < model.tokens_in(0.1, context=0)
    base, per_seq, per_token, _ = model.coefficients()
    assert (base, per_seq) == pytest.approx((0.03, 0.004), rel=0.05)
    assert per_token > 0.0012  # a token's cost at the recent contexts includes its attention


def test_a_prompt_token_is_priced_at_the_context_prompt_chunks_read():
    """Decodes deep in long streams beside prompt chunks near their start: the reported
    prompt token costs its attention at the chunks' contexts, less than a decode's."""
    model, rng = StepCostModel(), random.Random(6)
    for _ in range(400):
        num_seqs, chunk, start = rng.randint(1, 16), rng.choice([0, 32, 64]), rng.randint(0, 64)
        attended = num_seqs * 2000 + chunk * (start + chunk)
        seconds = 0.02 + 0.002 * num_seqs + 0.001 * (num_seqs + chunk) + 5e-7 * attended
        model.observe(
            StepWork(num_seqs, num_seqs + chunk, attended, chunk, chunk * (start + chunk)), seconds
        )
    fit = model.coefficients()
    assert fit.per_prompt_token_s < fit.per_token_s
    assert fit.per_prompt_token_s == pytest.approx(0.001 + 5e-7 * 80, rel=0.15)


def test_decode_only_load_keeps_predicting_right_and_stays_finite():
    """Decode steps tie tokens to sequences: the split is unknowable, the sum must hold."""
    model, rng = StepCostModel(), random.Random(1)
    for _ in range(5_000):
        n = rng.randint(1, 64)
        model.observe(StepWork(n, n), 0.02 + 0.005 * n)
    base, per_seq, per_token, _ = model.coefficients()
    assert base + 32 * (per_seq + per_token) == pytest.approx(0.02 + 0.005 * 32, rel=0.01)


TRACE = Path(__file__).parents[3] / "data/step_traces/interactive_pool_bench_sla.csv"
"""Every step of the interactive pool's engine through a bench_sla run (overload, protect,
offered load): batch 1 to 4, prompt lookup drafting 0 to 8 tokens, a core shared with
the offline pool's engine and Serve. Recursive least squares wound up on it: one step
set the per-sequence cost to 1.5 s, and its batch-1 prediction ran to 2 s."""


def test_recorded_pool_steps_are_predicted_and_the_fit_never_runs_away():
    steps = [[float(v) for v in row.values()] for row in csv.DictReader(TRACE.open())]
    model, errors, batch_1_s = StepCostModel(), [], []
    for num_seqs, num_tokens, attended, seconds in steps:
        if model.num_observations >= 20:
            predicted_s = model.step_s(int(num_seqs), int(num_tokens), int(attended))
            errors.append(abs(predicted_s - seconds) / seconds)
        model.observe(StepWork(int(num_seqs), int(num_tokens), int(attended)), seconds)
        base, per_seq, per_token, _ = model.coefficients()
        batch_1_s.append(base + per_seq + per_token)
    measured_batch_1_s = statistics.median(s for n, t, _, s in steps if n == 1 and t == 1)
    assert statistics.median(errors) < 0.08
    assert statistics.quantiles(errors, n=20)[-1] < 0.35  # p95
    assert max(batch_1_s) < 1.5 * measured_batch_1_s
    assert min(batch_1_s) > 0.5 * measured_batch_1_s


def test_a_step_slowed_by_another_process_barely_moves_the_fit():
    model, rng = StepCostModel(), random.Random(3)
    for _ in range(200):
        n = rng.randint(1, 8)
        model.observe(StepWork(n, n), (0.03 + 0.002 * n) * rng.uniform(0.95, 1.05))
    before_s = model.step_s(4, 4, 0)
    model.observe(StepWork(4, 4), 10 * before_s)  # the core was taken for most of this step
    assert model.step_s(4, 4, 0) == pytest.approx(before_s, rel=0.03)


def test_a_lasting_change_of_speed_is_followed_within_50_steps():
    """An engine that loses a thread (elastic_threads.py) steps twice as slowly from then on:
    the outlier weighting gives way once the slow steps keep coming."""
    model, rng = StepCostModel(), random.Random(5)
    for _ in range(200):
        n = rng.randint(1, 4)
        model.observe(StepWork(n, n), (0.03 + 0.002 * n) * rng.uniform(0.95, 1.05))
    for _ in range(50):
        n = rng.randint(1, 4)
        model.observe(StepWork(n, n), 2 * (0.03 + 0.002 * n) * rng.uniform(0.95, 1.05))
    assert model.step_s(2, 2, 0) == pytest.approx(2 * 0.034, rel=0.1)


def test_load_that_ties_base_to_batch_size_leaves_every_term_non_negative():
    """Decode steps at one batch size cannot tell the base from the per-sequence cost:
    the fit keeps both at least 0 and their sum right."""
    model, rng = StepCostModel(), random.Random(4)
    for _ in range(2_000):
        model.observe(StepWork(4, 4 + rng.choice([0, 3, 8]), 800), 0.034 * rng.uniform(0.9, 1.1))
    fit = model.coefficients()
    assert min(fit) >= 0
    assert model.step_s(4, 4, 800) == pytest.approx(0.034, rel=0.05)


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


def recorded_steps(engine, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, float, int]]:
    """Each step of `engine` as the fit observes it from now on: sequences, tokens, seconds,
    attended positions (the engine is shared between tests: the recording goes with this
    test)."""
    observed: list[tuple[int, int, float, int]] = []
    observe = engine.step_cost.observe

    def recording(work: StepWork, seconds: float) -> None:
        observed.append((work.num_seqs, work.num_tokens, seconds, work.attended))
        observe(work, seconds)

    monkeypatch.setattr(engine.step_cost, "observe", recording)
    return observed


def test_a_step_is_learnt_over_the_positions_it_read(engine, monkeypatch):
    """The fit learns a step over the attended positions the scheduler priced it at (a
    chunk's tokens each at the chunk's end), counted before the step advanced its requests:
    counted after, a 40-token prompt's first chunk read as twice the positions it did."""
    observed = recorded_steps(engine, monkeypatch)
    prompt = list(range(3001, 3041))  # a prompt no other test sends: nothing cached
    engine.add_request("prompt", prompt, greedy(2, ignore_eos=True))
    drain(engine)
    assert [(n, tokens, attended) for n, tokens, _, attended in observed] == [
        (1, 40, 40 * 40),
        (1, 1, 41),
    ]


def test_a_step_costs_what_delays_the_next_token_but_never_idle_time(engine, monkeypatch):
    """The loop's work between steps counts in the next step's cost while the engine has
    work left; a wait for new work does not."""
    observed = recorded_steps(engine, monkeypatch)
    engine.add_request("busy", list(range(1, 9)), greedy(4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
        time.sleep(0.2)  # the loop delivering outputs, slowly
    engine.add_request("after-idle", list(range(1, 9)), greedy(1, ignore_eos=True))
    drain(engine)
    observed_s = [seconds for _, _, seconds, _ in observed]
    assert min(observed_s[1:-1]) >= 0.2 > observed_s[0]
    assert observed_s[-1] < 0.2


def test_a_step_costs_the_making_of_its_outputs(engine, monkeypatch):
    """Detokenizing and the bookkeeping after the forward pass delay the next token as
    much as the pass does: the step's cost counts them."""
    observed = recorded_steps(engine, monkeypatch)
    emit = engine._emit

    def slow_emit(*args):
        time.sleep(0.1)
        return emit(*args)

    monkeypatch.setattr(engine, "_emit", slow_emit)
    engine.add_request("one", list(range(1, 9)), greedy(2, ignore_eos=True))
    drain(engine)
    assert len(observed) == 2 and min(seconds for _, _, seconds, _ in observed) >= 0.1
