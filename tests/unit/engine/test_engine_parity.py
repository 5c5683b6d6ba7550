"""Greedy outputs are token-for-token those of transformers, under batching and preemption."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import default_cache_dir
from engine.model.loader import resolve_model_dir
from testing.engine_helpers import greedy, run_requests

MAX_TOKENS = 12
NEAR_TIE = 1e-4

PROMPTS = [
    "Hi",
    "The quick brown fox",
    "The capital of France is",
    "def fibonacci(n):",
    "Write a haiku about the sea.",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "Once upon a time, in a small village at the edge of a great forest, there lived",
    "Explain photosynthesis in simple terms for a child who is curious about plants, "
    "sunlight, water and the air, why leaves are green in summer and turn red, orange "
    "or yellow in the autumn.",
]

# 16 blocks of 4 tokens = 64 slots for 8 requests of up to ~55 tokens: they cannot all
# fit, so some are preempted and recomputed; a 16-token budget chunks every long prompt.
TIGHT = dict(block_size=4, num_kv_blocks=16, max_num_batched_tokens=16, max_num_seqs=8)


@pytest.fixture(scope="module")
def hf_model():
    model_dir = resolve_model_dir("default", default_cache_dir())
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(
    hf_model, prompt: list[int], max_tokens: int, **kwargs
) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and its raw logits [n, vocab] at each generated position."""
    out = hf_model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        **kwargs,
    )
    return out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits).float()


def assert_same_greedy_tokens(ours: list[int], theirs: list[int], their_logits: torch.Tensor):
    """Equal, or equal up to a position where transformers' own top two logits tie."""
    for i, (mine, ref) in enumerate(zip(ours, theirs, strict=False)):
        if mine != ref:
            top2 = their_logits[i].topk(2)
            gap = float(top2.values[0] - top2.values[1])
            assert gap <= NEAR_TIE and mine in top2.indices.tolist(), (
                f"token {i}: ours {mine}, transformers {ref}; their top-2 gap {gap:.2e} "
                f"is no near-tie"
            )
            return
    assert ours == theirs


@pytest.mark.slow  # left out of `make test-fast`; `make test` runs it
def test_batched_chunked_preempted_greedy_matches_transformers(make_engine, hf_model, tokenizer):
    engine = make_engine(**TIGHT)
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    assert len({len(p) for p in prompts}) == len(prompts)
    assert max(len(p) for p in prompts) > 2 * TIGHT["max_num_batched_tokens"]
    params = greedy(MAX_TOKENS, logprobs=3)
    requests = {f"p{i}": (prompt, params) for i, prompt in enumerate(prompts)}

    completions = run_requests(engine, requests)

    assert engine.stats().num_preemptions > 0
    for request_id, (prompt, _) in requests.items():
        ours = completions[request_id]
        theirs, their_logits = hf_greedy(hf_model, prompt, MAX_TOKENS)
        assert_same_greedy_tokens(ours.token_ids, theirs, their_logits)
        their_logprobs = torch.log_softmax(their_logits, -1)
        for i, (token, logprob) in enumerate(zip(ours.token_ids, ours.logprobs, strict=True)):
            if token == theirs[i]:
                assert logprob.logprob == pytest.approx(float(their_logprobs[i, token]), abs=1e-3)
                top_values, _ = their_logprobs[i].topk(3)
                assert [lp for _, lp in logprob.top] == pytest.approx(top_values.tolist(), abs=1e-3)


def test_repetition_penalty_matches_transformers(engine, hf_model, tokenizer):
    prompt = tokenizer.encode("1, 2, 3, 1, 2, 3, 1, 2,")
    ours = run_requests(engine, {"rep": (prompt, greedy(8, repetition_penalty=1.3))})["rep"]
    theirs, their_logits = hf_greedy(hf_model, prompt, 8, repetition_penalty=1.3)
    plain, _ = hf_greedy(hf_model, prompt, 8)
    assert theirs != plain  # the penalty really bites on this prompt
    assert_same_greedy_tokens(ours.token_ids, theirs, their_logits)


def test_prompt_logprobs_match_transformers_chunked_and_with_the_prefix_cached(
    make_engine, hf_model, tokenizer
):
    engine = make_engine(**TIGHT, enable_prefix_caching=True)
    prompt = tokenizer.encode(PROMPTS[-1])
    assert len(prompt) > 2 * TIGHT["max_num_batched_tokens"]  # scored over several chunks
    run_requests(engine, {"warm": (prompt, greedy(1))})  # its blocks are now cached
    params = greedy(1, prompt_logprobs=2)
    completions = run_requests(engine, {"p": (prompt, params)})
    ours = completions["p"].prompt_logprobs
    assert completions["p"].num_cached_tokens == 0  # computed whole, to be scored
    with torch.inference_mode():
        theirs = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), -1)
    assert ours is not None and len(ours) == len(prompt) and ours[0] is None
    for i, score in enumerate(ours[1:], start=1):  # token i under the tokens before it
        assert score is not None
        assert score.logprob == pytest.approx(float(theirs[i - 1, prompt[i]]), abs=1e-3)
        assert [t for t, _ in score.top] == theirs[i - 1].topk(2).indices.tolist()
