"""Speculative decoding: exact output (greedy parity, rejection-sampling statistics),
lookahead rollback, the draft length and the n-gram proposer.

The engine tests run fp32 engines on the default model with a KV pool small
enough to force preemption; each configuration is loaded once per module. Greedy
parity runs in bf16 too: every dtype a pool may serve must keep the output exact.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
import xgrammar as xgr

from engine.config import EngineConfig, SpecDecodeConfig
from engine.engine import LLMEngine
from engine.grammar import GrammarState
from engine.model.chat import chat_prompt_ids
from engine.model.students import latest_student
from engine.outputs import EngineStats
from engine.request import Request
from engine.sampler import SampleRow, draw, probs_for, sample_row, verify
from engine.sampling_params import GrammarSpec, SamplingParams
from engine.spec_decode import (
    DraftLength,
    DraftModelProposer,
    NgramProposer,
    Proposal,
    Speculator,
    best_draft_len,
)

torch.set_num_threads(1)  # two shared cores: more threads only contend

BASE_CONFIG = dict(
    model="default",
    dtype="float32",
    block_size=16,
    num_kv_blocks=16,
    max_num_seqs=6,
    max_num_batched_tokens=64,
)
"""256 KV slots for ~500 tokens of live requests: preemption is certain."""

NGRAM = SpecDecodeConfig(method="ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=3)
WEAK_DRAFT = SpecDecodeConfig(
    method="draft", num_speculative_tokens=3, draft_model="default", draft_num_layers=4
)
"""The default model cut to 4 of its 30 layers: a draft that is often wrong."""
SELF_DRAFT = SpecDecodeConfig(method="draft", num_speculative_tokens=3, draft_model="default")

GROUNDED_TEXT = (
    "The harbour town of Elsmere sits at the mouth of the Vell river. Its fishing fleet of "
    "forty boats lands cod and herring every morning, and the market opens at six o'clock."
)


# ---- fixtures and helpers ----------------------------------------------------


@pytest.fixture(scope="module")
def engine_for() -> Callable[..., LLMEngine]:
    """`engine_for(spec, dtype="float32")`: an idle engine with that speculation config,
    built once."""
    engines: dict[tuple[SpecDecodeConfig | None, str], LLMEngine] = {}

    def get(spec: SpecDecodeConfig | None, dtype: str = "float32") -> LLMEngine:
        if (spec, dtype) not in engines:
            config = EngineConfig(**{**BASE_CONFIG, "dtype": dtype}, spec_decode=spec)
            engines[spec, dtype] = LLMEngine(config)
        engine = engines[spec, dtype]
        for request_id in list(engine.requests):  # left behind by a failed test
            engine.abort_request(request_id)
        return engine

    return get


@pytest.fixture(scope="module")
def plain_run(engine_for) -> Callable[..., object]:
    """`plain_run(fn, *args, dtype="float32")`: `fn(engine without speculation, *args)`,
    computed once."""
    results: dict[tuple, object] = {}

    def get(fn, *args, dtype: str = "float32"):
        key = (fn.__name__, dtype, *args)
        if key not in results:
            results[key] = fn(engine_for(None, dtype), *args)
        return results[key]

    return get


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)


def mixed_batch(engine: LLMEngine) -> dict[str, tuple[list[int], SamplingParams]]:
    """Speculating greedy requests of several lengths, plus ones that never speculate."""
    return {
        "copy": (
            chat_prompt_ids(
                engine.tokenizer,
                "Repeat this sentence exactly, twice: the quick brown fox "
                "jumps over the lazy dog near the old river bank.",
            ),
            greedy(28),
        ),
        "summary": (
            chat_prompt_ids(
                engine.tokenizer, f"Text: {GROUNDED_TEXT}\nSummarize the text in one sentence."
            ),
            greedy(24),
        ),
        "extract": (
            chat_prompt_ids(
                engine.tokenizer,
                f"Text: {GROUNDED_TEXT}\nHow many boats are in the fleet, "
                "and when does the market open?",
            ),
            greedy(20),
        ),
        "list": (
            chat_prompt_ids(engine.tokenizer, "List five fruits, one per line."),
            greedy(16, ignore_eos=True),
        ),
        "penalised": (
            chat_prompt_ids(engine.tokenizer, "Write two sentences about the sea."),
            greedy(18, repetition_penalty=1.3),
        ),
        "short": (chat_prompt_ids(engine.tokenizer, "What is the capital of France?"), greedy(6)),
        "sampled": (
            chat_prompt_ids(engine.tokenizer, "Tell me a fun fact."),
            SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True),
        ),
    }


def run_mixed_batch(engine: LLMEngine) -> dict[str, list[int]]:
    return run_all(engine, mixed_batch(engine))


def run_all(
    engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]
) -> dict[str, list[int]]:
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    tokens: dict[str, list[int]] = {request_id: [] for request_id in requests}
    for _ in range(2_000):
        if not engine.has_unfinished():
            assert_all_blocks_free(engine)
            return tokens
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    raise AssertionError("requests still unfinished after 2,000 steps")


def assert_all_blocks_free(engine: LLMEngine) -> None:
    """Every block of the target's pool, and of a draft model's own pool, is back to ref 0."""
    pools = [engine.kv.pool]
    if engine.speculator is not None and isinstance(engine.speculator.proposer, DraftModelProposer):
        assert not engine.speculator.proposer.shadows, "a finished request left its draft shadow"
        pools.append(engine.speculator.proposer.kv.pool)
    for pool in pools:
        assert [b.ref_count for b in pool.blocks] == [0] * pool.num_blocks
        assert pool.num_free_blocks == pool.num_blocks


def stats_delta(before: EngineStats, after: EngineStats) -> dict[str, int]:
    names = (
        "num_preemptions",
        "spec_num_drafts",
        "spec_num_draft_tokens",
        "spec_num_accepted_tokens",
    )
    return {name: getattr(after, name) - getattr(before, name) for name in names}


# ---- greedy parity -----------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
@pytest.mark.parametrize("spec", [NGRAM, WEAK_DRAFT], ids=["ngram", "draft4layers"])
def test_greedy_parity_mixed_batch_with_preemption(engine_for, plain_run, spec, dtype, monkeypatch):
    expected = plain_run(run_mixed_batch, dtype=dtype)

    engine = engine_for(spec, dtype)
    # Drafts priced free, so even the weak draft keeps proposing full-length drafts
    # and both acceptances and rejections land inside the preempted, mixed batch.
    monkeypatch.setattr(engine.speculator, "token_cost", lambda decoding: 0.0)
    before = engine.stats()
    requests = mixed_batch(engine)
    got = run_all(engine, requests)
    delta = stats_delta(before, engine.stats())

    for request_id, (_, params) in requests.items():
        if params.greedy:
            assert got[request_id] == expected[request_id], request_id
        else:  # sampled: another RNG path, but it must still run to its length
            assert len(got[request_id]) == params.max_tokens
    assert delta["num_preemptions"] > 0
    assert delta["spec_num_drafts"] > 0
    assert delta["spec_num_accepted_tokens"] > 0, "no draft was ever accepted"
    assert delta["spec_num_accepted_tokens"] < delta["spec_num_draft_tokens"], "no rejection"
    stats = engine.stats()
    assert sum(stats.spec_accepted_per_pos) == stats.spec_num_accepted_tokens
    assert 0 < stats.spec_acceptance_rate < 1
    assert 1 < stats.spec_mean_accepted_len < 1 + spec.num_speculative_tokens


def test_default_model_as_its_own_draft_accepts_everything(engine_for):
    engine = engine_for(SELF_DRAFT)
    before = engine.stats()
    prompts = {
        "a": (
            chat_prompt_ids(engine.tokenizer, "Name three colours."),
            greedy(14, ignore_eos=True),
        ),
        "b": (
            chat_prompt_ids(engine.tokenizer, f"Text: {GROUNDED_TEXT}\nWhere is Elsmere?"),
            greedy(10),
        ),
    }
    got = run_all(engine, prompts)
    delta = stats_delta(before, engine.stats())
    assert delta["spec_num_draft_tokens"] > 0
    assert delta["spec_num_accepted_tokens"] == delta["spec_num_draft_tokens"]
    assert engine.stats().spec_acceptance_rate == 1.0
    plain = engine_for(None)
    assert got == run_all(plain, prompts)


# ---- rollback ----------------------------------------------------------------


def rewrite_prompt(engine: LLMEngine) -> list[int]:
    return chat_prompt_ids(
        engine.tokenizer, f"Text: {GROUNDED_TEXT}\nRewrite the text in plain words."
    )


def trace_rewrite(engine: LLMEngine) -> tuple[dict[int, tuple], list[int]]:
    return trace_books(engine, rewrite_prompt(engine), greedy(48, ignore_eos=True))


def trace_books(
    engine: LLMEngine, prompt: list[int], params: SamplingParams
) -> tuple[dict[int, tuple], list[int]]:
    """After each step, by output length: (block table length, num_computed_tokens, K/V);
    and the output tokens."""
    engine.add_request("traced", prompt, params)
    trace: dict[int, tuple] = {}
    token_ids: list[int] = []
    while engine.has_unfinished():
        token_ids += [t for out in engine.step() for t in out.new_token_ids]
        tracked = engine.requests.get("traced")
        if tracked is None:  # finished: its blocks are gone
            break
        request = tracked.request
        # Between steps a request holds blocks for its computed tokens and no more:
        # the lookahead of rejected drafts has been given back.
        assert len(request.block_ids) == -(-request.num_computed_tokens // engine.kv.block_size)
        assert request.num_computed_tokens == request.num_tokens - 1 or not request.output_token_ids
        trace[request.num_output_tokens] = (
            len(request.block_ids),
            request.num_computed_tokens,
            computed_kv(engine, request),
        )
    assert_all_blocks_free(engine)
    return trace, token_ids


class ScriptedProposer:
    """Drafts from a known answer: right for a random number of tokens, then one wrong one.

    Its rejections land at every offset of a block, which the real proposers,
    cut short by the draft length after a few misses, rarely manage in a short test.
    """

    cooldown_steps = 1

    def __init__(self, answer: list[int], vocab_size: int, seed: int) -> None:
        self.answer, self.vocab_size, self.rng = answer, vocab_size, random.Random(seed)

    def propose(self, requests: dict[Request, int]) -> dict[Request, Proposal]:
        out = {}
        for request, k in requests.items():
            right = self.answer[request.num_tokens : request.num_tokens + k]
            num_right = self.rng.randint(0, len(right))
            drafts = right[:num_right]
            if num_right < len(right):
                drafts.append((right[num_right] + 1) % self.vocab_size)
            if drafts:
                out[request] = Proposal(drafts)
        return out

    def release(self, request: Request) -> None:
        pass


def computed_kv(engine: LLMEngine, request: Request) -> torch.Tensor:
    """Keys and values of the computed positions, first and last layer: [2, 2, n, KVH, D]."""
    size = engine.kv.block_size
    positions = torch.arange(request.num_computed_tokens)
    slots = torch.tensor(request.block_ids)[positions // size] * size + positions % size
    layers = [engine.runner.kv_caches[0], engine.runner.kv_caches[-1]]
    return torch.stack([torch.stack([k[slots], v[slots]]) for k, v in layers])


@pytest.mark.parametrize("proposer", ["ngram", "draft4layers", "scripted"])
def test_rollback_matches_plain_run(engine_for, plain_run, proposer):
    plain, answer = plain_run(trace_rewrite)
    engine = engine_for(WEAK_DRAFT if proposer == "draft4layers" else NGRAM)
    speculator = engine.speculator
    real_proposer = speculator.proposer
    if proposer == "scripted":
        prompt = rewrite_prompt(engine)
        speculator.proposer = ScriptedProposer(prompt + answer, engine.model.args.vocab_size, 3)
    before = engine.stats()
    try:
        spec_trace, spec_answer = trace_rewrite(engine)
    finally:
        speculator.proposer = real_proposer
    delta = stats_delta(before, engine.stats())
    num_rejected = delta["spec_num_draft_tokens"] - delta["spec_num_accepted_tokens"]
    assert num_rejected >= (10 if proposer == "scripted" else 1)
    assert spec_answer == answer

    common = sorted(set(plain) & set(spec_trace))
    assert len(common) >= 5
    for num_output in common:
        plain_blocks, plain_computed, plain_kv = plain[num_output]
        spec_blocks, spec_computed, spec_kv = spec_trace[num_output]
        assert (spec_blocks, spec_computed) == (plain_blocks, plain_computed), num_output
        # The cache of every computed position holds the accepted tokens' K/V,
        # not a rejected draft's.
        torch.testing.assert_close(spec_kv, plain_kv, atol=1e-4, rtol=1e-4)


# ---- the acceptance rule, statistically --------------------------------------

NUM_SAMPLES = 20_000
CHI2_CRITICAL_P001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}
"""Chi-square critical values at p = 0.001 by degrees of freedom (no scipy here)."""

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


def chi2_passes(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    """Counts consistent with `probs` at p = 0.001; a zero-probability token must never appear."""
    support = probs > 0
    if counts[~support].sum() > 0:
        return False
    expected = probs[support] * counts.sum()
    statistic = float(((counts[support] - expected) ** 2 / expected).sum())
    return statistic < CHI2_CRITICAL_P001[int(support.sum()) - 1]


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


def expected_rate(alpha: float, cost: float, k: int) -> float:
    return sum(alpha**i for i in range(k + 1)) / (1 + cost * k)


@pytest.mark.parametrize("alpha", [0.05, 0.3, 0.6, 0.95])
@pytest.mark.parametrize("cost", [0.0, 0.01, 0.1, 0.5])
def test_best_draft_len_is_the_argmax(alpha, cost):
    best = best_draft_len(alpha, cost, 8)
    rates = [expected_rate(alpha, cost, k) for k in range(9)]
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


# ---- the distilled student as the draft: the distribution, end to end ----------


@pytest.mark.slow  # left out of `make test-fast`; `make test` runs it
def test_student_draft_keeps_the_target_distribution(tiny_student_cache):
    """Sampled through the engine with the student proposing drafts, the first verified
    token (the second output) follows the target's own distribution given the first."""
    student = str(latest_student(tiny_student_cache))
    spec = SpecDecodeConfig(method="draft", num_speculative_tokens=3, draft_model=student)
    wide = dict(BASE_CONFIG, max_num_seqs=64, max_num_batched_tokens=512, num_kv_blocks=512)
    engine = LLMEngine(EngineConfig(**wide, spec_decode=spec))  # 64 at once: many samples
    # "Hello" first ~40% of the time; then four tokens at 0.35, 0.35, 0.24 and 0.07.
    prompt = chat_prompt_ids(engine.tokenizer, "Say hello.")
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=4, ignore_eos=True)
    requests = {f"s{seed}": (prompt, replace(params, seed=seed)) for seed in range(400)}
    before = engine.stats()
    outputs = run_all(engine, requests)
    delta = stats_delta(before, engine.stats())
    assert delta["spec_num_drafts"] > 0, "the student never drafted"
    assert delta["spec_num_accepted_tokens"] < delta["spec_num_draft_tokens"], "no rejection"

    firsts = [tokens[0] for tokens in outputs.values()]
    first = max(set(firsts), key=firsts.count)
    seconds = torch.tensor([tokens[1] for tokens in outputs.values() if tokens[0] == first])
    assert len(seconds) >= 120, "the prompt should make one first token likely"
    with torch.no_grad():
        logits = engine.model.compute_logits_dense(torch.tensor(prompt + [first]))[-1]
    probs = probs_for(logits.float(), params)
    counts = torch.bincount(seconds, minlength=probs.numel()).float()
    assert chi2_passes(counts, probs)


# ---- constrained requests through the engine: speculation changes nothing ------------

FRUIT_CHOICES = ["the red apple", "the green pear", "the yellow banana", "the purple plum"]
FRUIT_PROMPT = (
    "Pick one: the red apple, the green pear, the yellow banana or the purple plum. "
    "Answer with your pick only."
)
NUM_CONSTRAINED = 120
"""Seeded requests per side: enough for each choice that the model favours to be seen
tens of times."""
MAX_TV_DISTANCE = 0.23
"""Two samples of 120 from one distribution over four choices are this far apart (total
variation) with p < 0.001: simulated 20,000 times from uniform and skewed choices, the
99.9th percentile was 0.20-0.225."""


def total_variation(a: list[str], b: list[str]) -> float:
    """Half the L1 distance between the empirical distributions of `a` and `b`."""
    return 0.5 * sum(abs(a.count(c) / len(a) - b.count(c) / len(b)) for c in set(a) | set(b))


def choose_fruit(engine: LLMEngine, seeds: range) -> dict[int, str]:
    """Each seed's constrained answer (temperature 1.0, held to FRUIT_CHOICES)."""
    prompt = chat_prompt_ids(engine.tokenizer, FRUIT_PROMPT)
    grammar = GrammarSpec("choice", json.dumps(FRUIT_CHOICES))
    params = SamplingParams(max_tokens=12, temperature=1.0, grammar=grammar)
    requests = {f"fruit{seed}": (prompt, replace(params, seed=seed)) for seed in seeds}
    tokens = run_all(engine, requests)
    decode = engine.tokenizer.decode
    return {seed: decode(tokens[f"fruit{seed}"], skip_special_tokens=True) for seed in seeds}


@pytest.mark.slow  # left out of `make test-fast`; `make test` runs it
@pytest.mark.parametrize("spec", [NGRAM, WEAK_DRAFT], ids=["ngram", "draft4layers"])
def test_constrained_speculation_keeps_the_distribution_and_each_seed(engine_for, spec):
    """Constrained, speculating (prompt lookup, a 4-layer draft) and not: the choices are
    distributed alike over distinct seeds (total variation), and each seed's answer is
    the one decoding without drafts gives."""
    plain = choose_fruit(engine_for(None), range(2 * NUM_CONSTRAINED))
    engine = engine_for(spec)
    before = engine.stats()
    speculated = choose_fruit(engine, range(NUM_CONSTRAINED))
    delta = stats_delta(before, engine.stats())
    assert delta["spec_num_accepted_tokens"] > 0, "no draft was ever accepted"
    assert set(speculated.values()) <= set(FRUIT_CHOICES)
    assert all(speculated[seed] == plain[seed] for seed in speculated)
    other_seeds = [plain[seed] for seed in range(NUM_CONSTRAINED, 2 * NUM_CONSTRAINED)]
    assert total_variation(list(speculated.values()), other_seeds) < MAX_TV_DISTANCE
