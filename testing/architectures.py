"""Every served architecture in miniature, as transformers' own config classes build it:
random 2-layer checkpoints saved with the default model's tokenizer, for tests that hold
the engine to transformers' output (tests/unit/engine/test_architectures.py) or to
itself (tensor parallelism)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from engine.config import default_cache_dir
from engine.model.loader import resolve_model_dir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
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


def save_tiny_model(architecture: str, folder: Path) -> Path:
    """A random checkpoint of `architecture` (seed 0) saved in `folder`, with the default
    model's tokenizer beside it."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(ARCHITECTURES[architecture]()).save_pretrained(folder)
    default_dir = resolve_model_dir("default", default_cache_dir())
    for name in TOKENIZER_FILES:
        shutil.copy(default_dir / name, folder / name)
    return folder
