"""Speculation's acceptance rule, statistically (with and without a grammar), the draft
length policy, the n-gram proposer and who speculates: no engine, no model.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
import xgrammar as xgr

from engine.grammar import GrammarState
from engine.request import Request
from engine.sampler import SampleRow, draw, probs_for, sample_row, verify
from engine.sampling_params import SamplingParams
from engine.spec_decode import (
    DraftLength,
    NgramProposer,
    Proposal,
    Speculator,
    best_draft_len,
)
from testing.statistics import chi2_passes

torch.set_num_threads(1)  # two shared cores: more threads only contend

# ---- the acceptance rule, statistically --------------------------------------

NUM_SAMPLES = 20_000
TARGET_LOGITS = torch.tensor(
    [
        [1.0, 0.2, -0.5, 2.0, 0.0, -1.0],
        [-0.3, 1.2, 0.4, 0.0, 1.6, -0.8],
        [0.5, 0.5, 0.5, -1.0, 2.0, 0.0],
        [0.0, -2.0, 1.0, 1.0, 0.3, 0.7],
    ]
)  # [positions, V = 6]: the target's logits at the last real token and after each draft
DRAFT_LOGITS = torch.tensor(
    [
        [0.0, 1.5, 0.5, -1.0, 1.0, 0.3],
        [1.0, -0.5, 1.2, 0.8, -1.0, 0.0],
        [-1.0, 0.0, 2.0, 0.5, 0.5, 1.0],
    ]
)  # [k, V]: a draft that disagrees with the target everywhere it can

Rule = Callable[[torch.Tensor, SampleRow, list[int]], tuple[list[int], list]]


def always_accept(logits, row, draft_token_ids):
    """A deliberately wrong rule: keep every draft (then a bonus token, here the argmax)."""
    return [*draft_token_ids, int(logits[len(draft_token_ids)].argmax())], []


def emitted_counts(
    rule: Rule,
    params: SamplingParams,
    k: int,
    draft: str,
    seed: int,
    grammar: xgr.CompiledGrammar | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts of the first emitted token, and of the second where the first draft survived.

    Drafts are drawn from the draft's processed distributions for `draft="sampled"`, with
    the noise the target draws with (as engine.spec_decode's draft model does);
    `draft="one-hot"` proposes the same tokens every time, as prompt lookup does. With a
    `grammar`, each trial's request is held to it from its first token (a fresh matcher).
    """
    logits = TARGET_LOGITS[: k + 1]
    q = [probs_for(row, params) for row in DRAFT_LOGITS[:k]]
    first, second = torch.zeros(6), torch.zeros(6)
    for trial in range(NUM_SAMPLES):  # each trial is a request with its own seed
        trial_seed = seed * NUM_SAMPLES + trial
        state = GrammarState(grammar) if grammar is not None else None
        row = SampleRow(params, trial_seed, [], 0, (), grammar=state)
        if draft == "sampled":  # as the draft model does: racing with the target's noise
            draft_ids = [draw(q[i], trial_seed, i) for i in range(k)]
        else:
            draft_ids = [1, 4, 2][:k]  # token 1 is unlikely under the target
        tokens, _ = rule(logits, row, draft_ids)
        first[tokens[0]] += 1
        if len(tokens) > 1:
            second[tokens[1]] += 1
    return first, second


SAMPLING_CASES = {
    "k1-sampled-draft": (SamplingParams(temperature=1.0), 1, "sampled"),
    "k1-one-hot-draft": (SamplingParams(temperature=1.0), 1, "one-hot"),
    "k3-sampled-temp-topk-topp": (
        SamplingParams(temperature=0.8, top_k=5, top_p=0.95),
        3,
        "sampled",
    ),
}


@pytest.mark.parametrize("case", list(SAMPLING_CASES))
def test_verification_keeps_target_distribution(case):
    params, k, draft = SAMPLING_CASES[case]
    first, second = emitted_counts(verify, params, k, draft, seed=11)
    assert chi2_passes(first, probs_for(TARGET_LOGITS[0], params))
    if k > 1:  # given an accepted first draft, the next token follows the next target row
        assert second.sum() > 2_000
        assert chi2_passes(second, probs_for(TARGET_LOGITS[1], params))

    wrong, _ = emitted_counts(always_accept, params, k, draft, seed=11)
    assert not chi2_passes(wrong, probs_for(TARGET_LOGITS[0], params)), "the check is too weak"


SIX_TOKENS = ["a", "b", "c", "d", "e", "</s>"]
"""TARGET_LOGITS' vocabulary as text, the last its EOS, for a grammar over it."""
POSITIONAL_GRAMMAR = ("[ab][cd][ae]", [(0, 1), (2, 3), (0, 4)])
"""A regex allowing a different two of the six tokens at each position, and those ids."""


@pytest.fixture(scope="module")
def positional_grammar() -> xgr.CompiledGrammar:
    info = xgr.TokenizerInfo(SIX_TOKENS, stop_token_ids=[5])
    regex = xgr.Grammar.from_regex(POSITIONAL_GRAMMAR[0])
    return xgr.GrammarCompiler(info).compile_grammar(regex)


def constrained_target(position: int, params: SamplingParams) -> torch.Tensor:
    """The target's processed distribution at `position` among what the grammar allows."""
    allowed = list(POSITIONAL_GRAMMAR[1][position])
    masked = torch.full_like(TARGET_LOGITS[position], float("-inf"))
    masked[allowed] = TARGET_LOGITS[position][allowed]
    return probs_for(masked, params)


@pytest.mark.slow  # left out of `make test-fast`; `make test` runs it
@pytest.mark.parametrize("case", list(SAMPLING_CASES))
def test_verification_with_a_grammar_keeps_the_constrained_distribution(case, positional_grammar):
    """The statistical test above with each request held to a grammar: emitted tokens
    follow the target's distribution among the allowed tokens, whatever the drafts propose
    (sampled drafts often propose forbidden ones; the one-hot draft is allowed)."""
    params, k, draft = SAMPLING_CASES[case]
    first, second = emitted_counts(verify, params, k, draft, 13, positional_grammar)
    assert chi2_passes(first, constrained_target(0, params))
    if k > 1:  # after an accepted first draft: the next target row, the next allowed pair
        assert second.sum() > 1_000
        assert chi2_passes(second, constrained_target(1, params))

    wrong, _ = emitted_counts(always_accept, params, k, draft, 13, positional_grammar)
    assert not chi2_passes(wrong, constrained_target(0, params)), "the check is too weak"


@pytest.mark.parametrize("case", list(SAMPLING_CASES))
def test_verified_tokens_are_those_sampling_without_drafts_gives(case):
    params, k, _ = SAMPLING_CASES[case]
    logits = TARGET_LOGITS[: k + 1]
    rng = random.Random(5)
    for seed in range(200):
        row = SampleRow(params, seed, [], 3, ())
        plain = [
            sample_row(logits[i], SampleRow(params, seed, [], 3 + i, ())) for i in range(k + 1)
        ]
        draft = [rng.randrange(6) for _ in range(k)]
        tokens, _ = verify(logits, row, draft)
        kept = next((i for i in range(k) if draft[i] != plain[i]), k)
        assert tokens == plain[: kept + 1], (seed, draft)


# ---- draft length, proposers, who speculates ------------------------------------


def test_best_draft_len_weighs_acceptance_against_token_cost():
    # Memory-bound batch 1: a draft token costs ~1.5% of a step, long drafts pay even at
    # low acceptance; compute-bound big batch: the same acceptance buys no draft at all.
    assert best_draft_len(0.5, 0.015, 8) >= 4
    assert best_draft_len(0.9, 0.015, 8) == 8
    assert best_draft_len(0.1, 0.3, 8) == 0
    assert best_draft_len(0.9, 0.0, 8) == 8
    lengths = [best_draft_len(alpha / 10, 0.05, 8) for alpha in range(10)]
    assert lengths == sorted(lengths) and lengths[0] == 0 and lengths[-1] == 8


def test_a_draft_pays_for_the_tokens_it_delays_in_the_rest_of_the_batch():
    """12 streams at alpha 0.28 (the interactive pool's on bench_sla's chat prompts), a
    draft token ~4% of the step: alone each would draft; in the batch none pays for the
    tokens it delays."""
    assert best_draft_len(0.28, 0.036, 8) > 0
    assert best_draft_len(0.28, 0.036, 8, other_rows=11) == 0
    assert best_draft_len(0.9, 0.036, 8, other_rows=11) >= 4  # a copying stream still drafts


def expected_rate(alpha: float, cost: float, k: int, other_rows: int) -> float:
    return (other_rows + sum(alpha**i for i in range(k + 1))) / (1 + cost * k)


@pytest.mark.parametrize("alpha", [0.05, 0.3, 0.6, 0.95])
@pytest.mark.parametrize("cost", [0.0, 0.01, 0.1, 0.5])
@pytest.mark.parametrize("other_rows", [0, 3, 11])
def test_best_draft_len_is_the_argmax(alpha, cost, other_rows):
    best = best_draft_len(alpha, cost, 8, other_rows)
    rates = [expected_rate(alpha, cost, k, other_rows) for k in range(9)]
    assert rates[best] == pytest.approx(max(rates))


@pytest.mark.parametrize("cooldown_steps", [2, 8])
def test_draft_length_rests_after_misses_probes_and_recovers(cooldown_steps):
    lengths = DraftLength(max_k=4, cooldown_steps=cooldown_steps)
    cost = 0.2  # a big batch: a token costs a fifth of the step
    first = lengths.k_for("r", cost)
    assert first >= 1  # a new request gets the benefit of the doubt (alpha 0.5)
    k = first
    while k > 0:  # every draft fully rejected: alpha falls until no draft pays
        lengths.record("r", k, 0)
        k = lengths.k_for("r", cost)
    rest = [lengths.k_for("r", cost) for _ in range(cooldown_steps)]
    assert rest == [0] * (cooldown_steps - 1) + [1]  # then a 1-token probe
    for _ in range(8):  # drafts land again: alpha climbs, k grows back to max
        lengths.record("r", 1, 1)
    assert lengths.k_for("r", cost) == 4
    assert lengths.k_for("other", cost) == first  # per request
    lengths.forget("r")
    assert lengths.k_for("r", cost) == first


def test_draft_length_keeps_long_drafts_when_they_are_cheap():
    lengths = DraftLength(max_k=8, cooldown_steps=2)
    for _ in range(20):  # one token in three lands
        lengths.record("r", 3, 1)
    assert lengths.k_for("r", 0.2) <= 1
    assert lengths.k_for("r", 0.01) >= 4


def test_speculator_learns_what_a_draft_token_costs():
    speculator = Speculator(NgramProposer(1, 3), max_k=8)
    request = Request("r", [1, 2, 3], SamplingParams())
    for step in range(200):  # a decode step: 40 ms, plus 0.5 ms a draft token
        num_drafts = step % 9
        drafts = {request: Proposal([7] * num_drafts)} if num_drafts else {}
        speculator.observe_step({request: 1 + num_drafts}, drafts, 0.040 + 0.0005 * num_drafts)
    assert speculator.token_cost([request]) == pytest.approx(0.0005 / 0.040, rel=0.1)
    prefill = {request: 50}  # a prefill chunk is not a decode step: not learned from
    speculator.observe_step(prefill, {}, 5.0)
    assert speculator.token_cost([request]) == pytest.approx(0.0005 / 0.040, rel=0.1)


def ngram_draft(tokens: list[int], k: int, ngram_min: int = 1, ngram_max: int = 3) -> list[int]:
    request = Request("r", tokens, SamplingParams())
    proposals = NgramProposer(ngram_min, ngram_max).propose({request: k})
    return proposals[request].token_ids if request in proposals else []


def test_ngram_proposer_lookup():
    assert ngram_draft([1, 2, 3, 4, 1, 2], k=2) == [3, 4]
    # The longest matching suffix wins over a more recent shorter match.
    assert ngram_draft([5, 6, 7, 9, 1, 6, 7, 8, 5, 6, 7], k=3) == [9, 1, 6]
    # Among equally long matches, the most recent one wins.
    assert ngram_draft([1, 2, 1, 3, 1], k=2) == [3, 1]
    # A continuation is cut at the end of the tokens; it may run into the suffix itself.
    assert ngram_draft([7, 8, 7], k=5) == [8, 7]
    assert ngram_draft([1, 2, 3], k=2) == []  # no earlier occurrence: no proposal
    assert ngram_draft([1, 2, 3, 1], k=2, ngram_min=2) == []  # a 1-gram is below ngram_min
    assert ngram_draft([4, 1, 2, 9, 1, 2], k=1, ngram_min=2) == [9]
    assert ngram_draft([3, 3, 3, 3], k=2, ngram_max=2) == [3]  # the latest start leaves one


def test_speculator_skips_requests_it_cannot_verify_exactly():
    speculator = Speculator(NgramProposer(1, 3), max_k=4)
    tokens = [1, 2, 3, 1, 2]

    def decoding(request_id: str, **params) -> Request:
        request = Request(request_id, tokens, SamplingParams(**params))
        request.num_computed_tokens = len(tokens) - 1
        return request

    plain = decoding("plain", max_tokens=16)
    penalised = decoding("penalised", max_tokens=16, repetition_penalty=1.2)
    min_tokens = decoding("min", max_tokens=16, min_tokens=4)
    near_end = decoding("near-end", max_tokens=2)  # room for 1 draft plus the bonus token
    prefilling = Request("prefill", tokens, SamplingParams(max_tokens=16))
    proposals = speculator.propose([plain, penalised, min_tokens, near_end, prefilling])
    everyone = [plain, penalised, min_tokens, near_end, prefilling]
    drafts = {r: proposals[r].token_ids if r in proposals else [] for r in everyone}
    assert drafts[plain] == [3, 1, 2]
    assert drafts[near_end] == [3]
    assert drafts[penalised] == drafts[min_tokens] == drafts[prefilling] == []


class _FailingProposer(NgramProposer):
    """An n-gram proposer whose every proposal raises, as a broken draft model would."""

    def propose(self, requests: dict[Request, int]) -> dict[Request, Proposal]:
        raise RuntimeError("draft model lost")


def test_a_failing_proposer_costs_the_drafts_not_the_step(caplog):
    speculator = Speculator(_FailingProposer(1, 3), max_k=4)
    request = Request("r", [1, 2, 3, 1, 2], SamplingParams(max_tokens=16))
    request.num_computed_tokens = 4
    with caplog.at_level("ERROR", logger="engine.spec_decode"):
        assert speculator.propose([request]) == {}
    assert "draft proposal failed" in caplog.text
    speculator.proposer = NgramProposer(1, 3)  # the next step drafts again
    assert speculator.propose([request])[request].token_ids == [3, 1, 2]
