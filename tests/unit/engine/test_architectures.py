"""Every served architecture against transformers' own model: a tiny random checkpoint built
with transformers' config and model classes, saved, loaded by the engine, and generated
greedily through chunked prefill, preemption, the prefix cache and prompt lookup."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_engine_parity import assert_same_greedy_tokens, hf_greedy
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.config import EngineConfig, SpecDecodeConfig
from engine.engine import LLMEngine
from engine.model.args import ModelArgs
from engine.model.loader import load_model
from engine.model.rotary import position_freqs
from testing.architectures import ARCHITECTURES, SMALL, save_tiny_model
from testing.engine_helpers import greedy, run_requests

MAX_TOKENS = 32
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "woman who kept bees, and every morning she walked to the hives",
]
# 12 blocks of 4 tokens for 4 requests of up to ~70 tokens: some are preempted and
# recomputed; a 16-token budget chunks every prompt past it.
TIGHT = dict(block_size=4, num_kv_blocks=24, max_num_batched_tokens=16, max_num_seqs=4)
NGRAM = SpecDecodeConfig(method="ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=3)


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def model_dir(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved random checkpoint of one architecture, with the default model's tokenizer."""
    return save_tiny_model(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def hf_model(model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def engine_for(model_dir: Path, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", **overrides))


def assert_matches_transformers(engine: LLMEngine, hf_model, prompts: list[list[int]]) -> None:
    """Greedy tokens equal to transformers' (up to its own near-ties), logprobs within 1e-3."""
    params = greedy(MAX_TOKENS, logprobs=1, ignore_eos=True)
    requests = {f"p{i}": (prompt, params) for i, prompt in enumerate(prompts)}
    completions = run_requests(engine, requests)
    for request_id, (prompt, _) in requests.items():
        ours = completions[request_id]
        theirs, their_logits = hf_greedy(hf_model, prompt, MAX_TOKENS, min_new_tokens=MAX_TOKENS)
        assert_same_greedy_tokens(ours.token_ids, theirs, their_logits)
        their_logprobs = torch.log_softmax(their_logits, -1)
        for i, (token, logprob) in enumerate(zip(ours.token_ids, ours.logprobs, strict=True)):
            if token != theirs[i]:
                break  # a near-tie: the rest follows another path
            assert logprob.logprob == pytest.approx(float(their_logprobs[i, token]), abs=1e-3)


def encode_all(tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    return [tokenizer.encode(text) for text in PROMPTS]


def test_logits_match_transformers(model_dir: Path, hf_model, tokenizer) -> None:
    model, _ = load_model(EngineConfig(model=str(model_dir), dtype="float32"))
    prompt = torch.tensor(tokenizer.encode(PROMPTS[-1]))
    with torch.inference_mode():
        ours = model.compute_logits_dense(prompt)
        theirs = hf_model(prompt[None]).logits[0].float()
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.slow  # left out of `make test-fast`; `make test` runs it
def test_chunked_preempted_and_prefix_cached_greedy_matches_transformers(
    model_dir: Path, hf_model, tokenizer
) -> None:
    engine = engine_for(model_dir, **TIGHT, enable_prefix_caching=True)
    prompts = encode_all(tokenizer)
    assert max(len(p) for p in prompts) > 2 * TIGHT["max_num_batched_tokens"]
    assert_matches_transformers(engine, hf_model, prompts)
    assert engine.stats().num_preemptions > 0
    run_requests(engine, {"warm": (prompts[-1], greedy(1))})  # its blocks are now cached
    completion = run_requests(engine, {"hit": (prompts[-1], greedy(MAX_TOKENS, ignore_eos=True))})
    assert completion["hit"].num_cached_tokens > 0
    theirs, their_logits = hf_greedy(hf_model, prompts[-1], MAX_TOKENS, min_new_tokens=MAX_TOKENS)
    assert_same_greedy_tokens(completion["hit"].token_ids, theirs, their_logits)


@pytest.mark.slow  # left out of `make test-fast`; `make test` runs it
def test_prompt_lookup_greedy_matches_transformers(model_dir: Path, hf_model, tokenizer) -> None:
    engine = engine_for(model_dir, max_num_batched_tokens=64, max_num_seqs=4, spec_decode=NGRAM)
    assert_matches_transformers(engine, hf_model, encode_all(tokenizer))
    assert engine.stats().spec_num_draft_tokens > 0


def test_unsupported_architecture_is_refused_by_name() -> None:
    config = {**SMALL, "model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]}
    with pytest.raises(ValueError, match="unsupported architecture 'gpt_neox'.*GPTNeoX"):
        ModelArgs.from_hf_config(config)


def test_longrope_takes_the_long_factors_past_the_original_context() -> None:
    """Where transformers' parity tests cannot reach (it switches a whole sequence once it
    outgrows the pretraining context), each position has transformers' frequencies for
    a sequence ending there, and its gain."""
    config = ARCHITECTURES["phi3"]()
    args = ModelArgs.from_hf_config(config.to_dict())
    freqs, gain = position_freqs(args, config.max_position_embeddings)
    for position in (0, 100, 255, 256, 300, 511):
        inv_freq, their_gain = ROPE_INIT_FUNCTIONS["longrope"](config, seq_len=position + 1)
        torch.testing.assert_close(freqs[position], position * inv_freq, rtol=1e-5, atol=1e-5)
        assert gain == pytest.approx(their_gain)
