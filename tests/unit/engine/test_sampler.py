"""Sampler maths on hand-made logits: masks, temperature, penalties and biases against
transformers' processors, seeded draws, verification of drafts (sampling through the
engine is in test_sampling_through_engine.py)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
)

from engine.sampler import (
    SampleRow,
    adjust_logits,
    apply_repetition_penalty,
    draw,
    mask_top_k_top_p,
    probs_for,
    sample,
    sample_row,
    verify,
)
from engine.sampling_params import SamplingParams
from testing.reference_sampling import OpenAIPenalties

NEG_INF = float("-inf")


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()


def kept(masked: torch.Tensor) -> list[int]:
    return torch.isfinite(masked).nonzero().flatten().tolist()


def row(
    params: SamplingParams,
    seen: tuple[int, ...] = (),
    num_output: int = 0,
    banned=(),
    output: tuple[int, ...] = (),
) -> SampleRow:
    return SampleRow(params, 0, list(seen), num_output, banned, list(output))


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


@settings(max_examples=100, deadline=None)
@given(
    values=st.lists(st.floats(-20, 20), min_size=2, max_size=12),
    temperature=st.floats(0.1, 3.0),
    min_p=st.floats(0.0, 1.0),
)
def test_min_p_matches_transformers_min_p_warper(
    values: list[float], temperature: float, min_p: float
):
    logits = torch.tensor(values)
    params = SamplingParams(temperature=temperature, min_p=min_p)
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature), MinPLogitsWarper(min_p)])
    theirs = torch.softmax(warpers(torch.zeros(1, 0, dtype=torch.long), logits[None])[0], -1)
    ours = probs_for(logits, params)
    assert torch.equal(ours > 0, theirs > 0)
    assert torch.allclose(ours, theirs, atol=1e-6)


def test_min_p_drops_tokens_below_its_share_of_the_likeliest():
    probs = probs_for(logits_of([0.5, 0.3, 0.15, 0.05]), SamplingParams(min_p=0.3))
    assert (probs > 0).tolist() == [True, True, True, False]  # 0.05 < 0.3 x 0.5 <= 0.15
    assert probs.sum() == pytest.approx(1.0)


penalty = st.floats(-2.0, 2.0)


@settings(max_examples=100, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 9), min_size=1, max_size=8),
    output=st.lists(st.integers(0, 9), max_size=12),
    presence=penalty,
    frequency=penalty,
    repetition=st.floats(0.5, 2.0),
    bias=st.dictionaries(st.integers(0, 9), st.floats(-100, 100), max_size=4),
)
def test_biases_and_penalties_match_the_reference_processors(
    prompt, output, presence, frequency, repetition, bias
):
    """transformers' sequence bias and repetition penalty, then OpenAI's presence and
    frequency rule, in that order (vLLM's): what adjust_logits computes."""
    logits = torch.randn(10, generator=torch.Generator().manual_seed(len(prompt + output)))
    params = SamplingParams(
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        logit_bias=tuple(bias.items()),
    )
    references = LogitsProcessorList(
        [
            RepetitionPenaltyLogitsProcessor(repetition),
            OpenAIPenalties(len(prompt), presence, frequency),
        ]
    )
    if bias:  # transformers refuses an empty bias list
        references.insert(0, SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()]))
    theirs = references(torch.tensor([prompt + output]), logits[None])[0]
    ours = adjust_logits(logits, row(params, seen=(*prompt, *output), output=tuple(output)))
    assert torch.allclose(ours, theirs, atol=1e-5)


def test_penalties_count_the_output_only():
    logits = torch.zeros(4)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    adjusted = adjust_logits(logits, row(params, seen=(3, 1, 1), output=(1, 1)))
    assert adjusted.tolist() == [0.0, -1.0, 0.0, 0.0]  # 2 x 0.25 + 0.5; the prompt's 3 is free


def test_logit_bias_forces_and_bans_a_greedy_choice():
    logits = torch.tensor([[2.0, 1.5, 0.0], [2.0, 1.5, 0.0]])
    forced = SamplingParams(temperature=0.0, logit_bias=((2, 100.0),))
    banned = SamplingParams(temperature=0.0, logit_bias=((0, -100.0),))
    assert sample(logits, [row(forced), row(banned)])[0] == [2, 1]
    assert sample(logits, [row(SamplingParams(temperature=0.0))] * 2)[0] == [0, 0]


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


# ---- verification with penalties ------------------------------------------------------


def test_verification_counts_accepted_drafts_as_output_for_the_penalties():
    """Token 3 leads by 1 everywhere; once the output holds it, a frequency penalty of 2
    makes token 2 the choice, so the second draft 3 is rejected."""
    logits = torch.tensor([[0.0, 0.0, 1.0, 2.0]] * 4)
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    tokens, _ = verify(logits, row(params), [3, 3, 3])
    assert tokens == [3, 2]


PENALISED = {
    "presence-frequency": SamplingParams(presence_penalty=1.5, frequency_penalty=0.7),
    "bias-repetition-min-p": SamplingParams(
        repetition_penalty=1.3, logit_bias=((1, 2.0), (4, -3.0)), min_p=0.05
    ),
    "greedy-penalised": SamplingParams(temperature=0.0, frequency_penalty=0.4),
}


@pytest.mark.parametrize("case", list(PENALISED))
def test_verified_tokens_with_penalties_are_those_sampling_without_drafts_gives(case):
    """Each emitted token equals the plain draw at its position, the output before it
    (accepted drafts included) fed to the penalties by hand."""
    params, k = PENALISED[case], 4
    logits = torch.randn(k + 1, 6, generator=torch.Generator().manual_seed(3))
    prompt, before = [1, 4, 4], [4, 1]
    draft_gen = torch.Generator().manual_seed(8)
    for seed in range(100):
        plain: list[int] = []
        for i in range(k + 1):
            output = [*before, *plain]
            here = SampleRow(params, seed, [*prompt, *output], len(output), (), output)
            plain.append(sample_row(logits[i], here))
        draft = torch.randint(0, 6, (k,), generator=draft_gen).tolist()
        draft[: seed % (k + 1)] = plain[: seed % (k + 1)]  # accept a varying prefix
        start = SampleRow(params, seed, [*prompt, *before], len(before), (), before)
        tokens, _ = verify(logits, start, draft)
        kept = next((i for i in range(k) if draft[i] != plain[i]), k)
        assert tokens == plain[: kept + 1], (seed, draft)


# ---- seeded draws ---------------------------------------------------------------------


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
