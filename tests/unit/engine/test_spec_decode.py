"""Speculative decoding through the engine: exact output (greedy parity, the student
draft's distribution, constrained requests seed by seed) and lookahead rollback. The
acceptance rule's statistics and the draft length are test_spec_verify.py's.

The engine tests run fp32 engines on the default model with a KV pool small
enough to force preemption; each configuration is loaded once per module. Greedy
parity runs in bf16 too: every dtype a pool may serve must keep the output exact.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from engine.config import EngineConfig, SpecDecodeConfig
from engine.engine import LLMEngine
from engine.model.chat import chat_prompt_ids
from engine.model.students import latest_student
from engine.outputs import EngineStats
from engine.request import Request
from engine.sampler import probs_for
from engine.sampling_params import GrammarSpec, SamplingParams
from engine.spec_decode import (
    DraftModelProposer,
)
from testing.fakes import ScriptedProposer
from testing.statistics import chi2_passes

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
    computed, gained = stats.spec_tokens_per_decode
    assert stats.spec_num_decode_rows >= stats.spec_num_drafts
    assert 1 < gained < computed <= 1 + spec.num_speculative_tokens


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
def test_constrained_speculation_keeps_the_distribution_and_each_seed(
    engine_for, plain_run, spec, monkeypatch
):
    """Constrained, speculating (prompt lookup, a 4-layer draft) and not: the choices are
    distributed alike over distinct seeds (total variation), and each seed's answer is
    the one decoding without drafts gives (computed once for both proposers). Every step
    drafts its full length: exactness holds whatever the length, and the adaptive one,
    fitted to step times, decided on a loaded machine that no draft paid."""
    plain = plain_run(choose_fruit, range(2 * NUM_CONSTRAINED))
    engine = engine_for(spec)
    full_length = spec.num_speculative_tokens
    monkeypatch.setattr(engine.speculator.draft_length, "k_for", lambda *_: full_length)
    before = engine.stats()
    speculated = choose_fruit(engine, range(NUM_CONSTRAINED))
    delta = stats_delta(before, engine.stats())
    assert delta["spec_num_accepted_tokens"] > 0, "no draft was ever accepted"
    assert set(speculated.values()) <= set(FRUIT_CHOICES)
    assert all(speculated[seed] == plain[seed] for seed in speculated)
    other_seeds = [plain[seed] for seed in range(NUM_CONSTRAINED, 2 * NUM_CONSTRAINED)]
    assert total_variation(list(speculated.values()), other_seeds) < MAX_TV_DISTANCE
