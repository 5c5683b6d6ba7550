"""Sampler maths on hand-made logits, and seeded sampling through the engine."""

from __future__ import annotations

import math

import pytest
import torch
from engine_helpers import drain, greedy, run_requests
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.model.chat import chat_prompt_ids
from engine.sampler import (
    SampleRow,
    apply_repetition_penalty,
    draw,
    mask_top_k_top_p,
    probs_for,
    sample,
)
from engine.sampling_params import SamplingParams

NEG_INF = float("-inf")


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()


def kept(masked: torch.Tensor) -> list[int]:
    return torch.isfinite(masked).nonzero().flatten().tolist()


def row(
    params: SamplingParams, seen: tuple[int, ...] = (), num_output: int = 0, banned=()
) -> SampleRow:
    return SampleRow(params, 0, list(seen), num_output, banned)


# ---- masks ---------------------------------------------------------------------


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([3.0, 1.0, 2.0, 0.0])
    assert kept(mask_top_k_top_p(logits, top_k=2, top_p=1.0)) == [0, 2]


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = logits_of([0.15, 0.5, 0.05, 0.3])
    assert kept(mask_top_k_top_p(logits, top_k=0, top_p=0.75)) == [1, 3]  # 0.5 + 0.3 >= 0.75
    assert kept(mask_top_k_top_p(logits, top_k=0, top_p=0.5)) == [1]
    assert kept(mask_top_k_top_p(logits, top_k=0, top_p=0.51)) == [1, 3]


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    logits = logits_of([0.4, 0.3, 0.2, 0.1])
    assert kept(mask_top_k_top_p(logits, top_k=0, top_p=0.5)) == [0, 1]
    # After top-k=2 the mass is 4/7, 3/7: the first token alone already reaches 0.5.
    assert kept(mask_top_k_top_p(logits, top_k=2, top_p=0.5)) == [0]


def test_disabled_masks_leave_logits_untouched():
    logits = torch.tensor([1.0, 2.0, 3.0])
    assert torch.equal(mask_top_k_top_p(logits, top_k=0, top_p=1.0), logits)
    assert torch.equal(mask_top_k_top_p(logits, top_k=5, top_p=1.0), logits)


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(st.floats(-20, 20), min_size=1, max_size=12),
    top_k=st.integers(0, 14),
    top_p=st.floats(0.01, 1.0),
)
def test_masks_keep_a_nonempty_top_set(values: list[float], top_k: int, top_p: float):
    logits = torch.tensor(values)
    masked = mask_top_k_top_p(logits, top_k, top_p)
    survivors = torch.isfinite(masked)
    assert survivors[logits.argmax()]
    assert torch.equal(masked[survivors], logits[survivors])
    if top_k:
        assert int(survivors.sum()) <= top_k
    if not survivors.all():
        assert logits[survivors].min() >= logits[~survivors].max()


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([2.0, 1.0, 0.0])
    cold = probs_for(logits, SamplingParams(temperature=0.5))
    warm = probs_for(logits, SamplingParams(temperature=2.0))
    assert cold[0] > torch.softmax(logits, -1)[0] > warm[0]
    assert math.isclose(float(cold.sum()), 1.0, rel_tol=1e-6)


# ---- penalties and bans -----------------------------------------------------------


def test_repetition_penalty_shrinks_positive_and_grows_negative_seen_logits():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    penalised = apply_repetition_penalty(logits, [0, 1, 1], 2.0)
    assert penalised.tolist() == [1.0, -4.0, 1.0, 0.5]
    assert logits.tolist() == [2.0, -2.0, 1.0, 0.5]  # input untouched


def test_repetition_penalty_changes_the_greedy_choice():
    logits = torch.tensor([[2.0, 1.5, 0.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert sample(logits, [row(params)])[0] == [0]
    assert sample(logits, [row(params, seen=(0,))])[0] == [1]


def test_min_tokens_bans_stop_tokens_only_until_reached():
    logits = torch.tensor([[5.0, 1.0, 0.0]])
    params = SamplingParams(temperature=0.0, min_tokens=2)
    assert sample(logits, [row(params, num_output=1, banned=(0,))])[0] == [1]
    assert sample(logits, [row(params, num_output=2, banned=(0,))])[0] == [0]


def test_logprob_is_of_the_chosen_token_under_the_raw_model_with_the_likeliest_beside():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    raw = torch.log_softmax(logits[0], -1)
    params = SamplingParams(temperature=0.0, repetition_penalty=3.0, logprobs=2)
    token_ids, logprobs = sample(logits, [row(params, seen=(1,))])
    assert token_ids == [2]
    assert logprobs[0] is not None
    assert logprobs[0].logprob == pytest.approx(float(raw[2]))
    assert [t for t, _ in logprobs[0].top] == [1, 2]  # by raw likelihood, penalty or not
    assert [lp for _, lp in logprobs[0].top] == pytest.approx([float(raw[1]), float(raw[2])])
    chosen_only = SamplingParams(temperature=0.0, logprobs=0)
    assert sample(logits, [row(chosen_only)])[1][0].top == ()
    assert sample(logits, [row(SamplingParams(temperature=0.0))])[1] == [None]


def test_sample_with_no_rows_returns_nothing():
    assert sample(torch.empty(0, 5), []) == ([], [])


# ---- seeded sampling through the engine ---------------------------------------------

SEEDED = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.95, seed=1234)


def test_seeded_request_is_reproducible_whatever_shares_the_batch(engine, tokenizer):
    prompt = chat_prompt_ids(tokenizer, "Tell me a story about a dragon.")
    alone = run_requests(engine, {"seeded": (prompt, SEEDED)})["seeded"]

    others = {
        "greedy": (chat_prompt_ids(tokenizer, "What is 2+2?"), greedy(8)),
        "unseeded": (chat_prompt_ids(tokenizer, "Name a colour."), SamplingParams(max_tokens=8)),
        "other-seed": (prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=99)),
    }
    for request_id, (other_prompt, params) in others.items():
        engine.add_request(request_id, other_prompt, params)
    engine.step()  # the seeded request now joins mid-flight, at another batch position
    engine.add_request("seeded", prompt, SEEDED)
    crowded = drain(engine)

    assert crowded["seeded"].token_ids == alone.token_ids
    assert crowded["other-seed"].token_ids != alone.token_ids  # the seed matters


def test_min_tokens_holds_back_eos(engine, tokenizer):
    prompt = chat_prompt_ids(tokenizer, "Reply with one word: yes or no?")
    short = run_requests(engine, {"free": (prompt, greedy(16))})["free"]
    assert short.finish_reason == "stop" and len(short.token_ids) < 6

    held = run_requests(engine, {"held": (prompt, greedy(16, min_tokens=6))})["held"]
    assert tokenizer.eos_token_id not in held.token_ids[:6]
    assert len(held.token_ids) >= 6


def test_a_draw_is_fixed_by_seed_and_position_and_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    assert draw(probs, seed=7, position=3) == draw(probs.clone(), seed=7, position=3)
    by_position = {draw(probs, seed=7, position=p) for p in range(40)}
    assert len(by_position) > 1  # positions are not one stream replayed
    counts = torch.bincount(torch.tensor([draw(probs, s, 0) for s in range(20_000)]), minlength=5)
    assert counts[4] == 0  # a token of probability zero never wins the race
    expected = probs[:4] * counts.sum()
    chi2 = float(((counts[:4] - expected) ** 2 / expected).sum())
    assert chi2 < 16.27  # 3 degrees of freedom, p = 0.001
