"""Every served architecture against transformers' own model: a tiny random checkpoint built
with transformers' config and model classes, saved, loaded by the engine, and generated
greedily through chunked prefill, preemption, the prefix cache and prompt lookup."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_engine_parity import assert_same_greedy_tokens, hf_greedy
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    PretrainedConfig,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.config import EngineConfig, SpecDecodeConfig, default_cache_dir
from engine.engine import LLMEngine
from engine.model.args import ModelArgs
from engine.model.loader import load_model, resolve_model_dir
from engine.model.rotary import position_freqs
from testing.engine_helpers import greedy, run_requests

MAX_TOKENS = 32
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "woman who kept bees, and every morning she walked to the hives",
]
SMALL = dict(
    vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    initializer_range=0.1, tie_word_embeddings=False,
)  # fmt: skip
"""A 2-layer GQA model on the default model's vocabulary; weights wide enough (0.1) that
greedy picks are rarely near-ties."""
WINDOW = 12
"""Sliding windows shorter than a prefill chunk: prompts and outputs run far past them."""
MOE = dict(num_experts_per_tok=2, norm_topk_prob=True)
# 12 blocks of 4 tokens for 4 requests of up to ~70 tokens: some are preempted and
# recomputed; a 16-token budget chunks every prompt past it.
TIGHT = dict(block_size=4, num_kv_blocks=24, max_num_batched_tokens=16, max_num_seqs=4)
NGRAM = SpecDecodeConfig(method="ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=3)

ARCHITECTURES: dict[str, Callable[[], PretrainedConfig]] = {
    "llama3": lambda: LlamaConfig(
        **SMALL,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
            rope_theta=500000.0,
        ),  # fmt: skip
    ),
    "mistral": lambda: MistralConfig(**SMALL, sliding_window=WINDOW),
    "qwen2": lambda: Qwen2Config(**SMALL),
    "qwen3": lambda: Qwen3Config(**SMALL, head_dim=32),
    "mixtral": lambda: MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": lambda: Qwen2MoeConfig(
        **SMALL,
        num_experts=4,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=96,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        num_experts_per_tok=2,
    ),  # fmt: skip
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **SMALL, head_dim=32, num_experts=4, moe_intermediate_size=64, **MOE
    ),
    "phi3": lambda: Phi3Config(
        **{**SMALL, "max_position_embeddings": 512},
        original_max_position_embeddings=256,
        rope_scaling=dict(
            type="longrope",
            short_factor=[1.0 + i / 16 for i in range(8)],
            long_factor=[2.0 + i for i in range(8)],
        ),  # fmt: skip
        pad_token_id=0,
    ),
    "gemma3": lambda: Gemma3TextConfig(
        **{**SMALL, "tie_word_embeddings": True},
        head_dim=32,
        query_pre_attn_scalar=64,
        sliding_window=WINDOW + 8,
        layer_types=["sliding_attention", "full_attention"],
        final_logit_softcapping=30.0,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    ),  # fmt: skip
}
"""Each architecture as a platform team would bring it, in miniature: Llama 3.x with its
rope scaling, Mistral (a sliding window), Qwen2 (q/k/v bias), Qwen3 (q/k norm), Mixtral
(4 experts, top 2), Qwen2-MoE (a shared expert, a dense layer, top-k weights kept
unnormalised), Qwen3-MoE (normalised), Phi-3 (fused projections, LongRoPE's short
factors and gain), Gemma 3 ((1 + w) norms around both blocks and on q/k, scaled
embeddings, its attention scale, soft-capped logits, a sliding layer with its own rotary
base beside a scaled global one)."""


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def model_dir(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved random checkpoint of one architecture, with the default model's tokenizer."""
    folder = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(ARCHITECTURES[request.param]()).save_pretrained(folder)
    default_dir = resolve_model_dir("default", default_cache_dir())
    for name in TOKENIZER_FILES:
        shutil.copy(default_dir / name, folder / name)
    return folder


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
