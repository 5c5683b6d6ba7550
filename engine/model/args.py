"""The architecture of a checkpoint, read from its config.json into one frozen record.

Every architecture the engine serves is one decoder (engine.model.llama) whose
differences are data here, not a subclass: which projections carry a bias,
whether q/k are normalised per head, a mixture-of-experts feed-forward and how it
routes, how rotary embeddings are scaled, Gemma's norms, scales and soft-capping.
One reader per `model_type` turns a config.json into those fields; a type without
one is refused at load, by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Config = dict[str, Any]


@dataclass(frozen=True)
class MoEArgs:
    """A sparse mixture-of-experts feed-forward (engine.model.moe)."""

    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int
    """Of each routed expert."""
    norm_topk_prob: bool
    """Renormalise the top-k routing weights to sum to 1 (Mixtral: a softmax over the
    top-k); False keeps them as the softmax over all experts gave them (Qwen2-MoE)."""
    layers: tuple[int, ...]
    """Layers whose feed-forward is sparse; the others keep a dense MLP."""
    shared_intermediate_size: int = 0
    """A shared expert every token goes through, gated by a sigmoid (Qwen2-MoE); 0: none."""


@dataclass(frozen=True)
class ModelArgs:
    """The architecture of a Llama-family checkpoint, read from its config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    """RMSNorm over each q and k head before the rotation (Qwen3)."""
    moe: MoEArgs | None = None
    hidden_act: str = "silu"
    """The gate's activation: `silu` (SwiGLU) or `gelu_pytorch_tanh` (GeGLU, Gemma)."""
    norm_offset: float = 0.0
    """Added to every RMSNorm weight at load: Gemma stores it as weight - 1."""
    sandwich_norms: bool = False
    """Attention and MLP outputs normalised again before their residual add (Gemma 2/3)."""
    embed_scale: float = 1.0
    """Embeddings are multiplied by it (Gemma: sqrt(hidden_size))."""
    query_pre_attn_scalar: float | None = None
    """Attention scores scaled by its -1/2 power instead of head_dim's (Gemma)."""
    final_logit_softcap: float | None = None
    """Logits squashed to (-cap, cap) by cap * tanh(logits / cap) (Gemma)."""
    sliding_window: int | None = None
    """Each query of a sliding layer sees this many positions, its own the last (Mistral)."""
    sliding_layers: tuple[int, ...] = ()
    """The layers with that window: all of Mistral's, Gemma 3's local ones."""
    local_rope_theta: float | None = None
    """Sliding layers rotate with this base and no scaling (Gemma 3); None: as the others."""

    @classmethod
    def from_hf_config(cls, cfg: Config) -> ModelArgs:
        """Read a config.json (transformers 4.x or 5.x rope layout); ValueError naming the
        architecture when the engine does not serve it."""
        model_type = cfg.get("model_type") or _type_of(cfg.get("architectures") or [])
        reader = ARCHITECTURES.get(model_type)
        if reader is None:
            raise ValueError(
                f"unsupported architecture {model_type!r} ({cfg.get('architectures')}): "
                f"tierserve serves {', '.join(sorted(ARCHITECTURES))}"
            )
        return cls(**{**_common(cfg), **reader(cfg)})


def _type_of(architectures: list[str]) -> str:
    """The model_type an old config without one means (a bare Llama config by default)."""
    for arch in architectures:
        for model_type, prefix in _ARCH_PREFIXES.items():
            if arch.startswith(prefix):
                return model_type
    return "llama" if not architectures else architectures[0]


def _common(cfg: Config) -> Config:
    """The fields every Llama-family config.json spells the same way."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_theta = float(cfg.get("rope_theta") or rope.pop("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor < 1) are not supported")
    heads = cfg["num_attention_heads"]
    return dict(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=None if rope_type == "default" else _rope_scaling(cfg, rope),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        **_sliding_window(cfg),
    )


def _rope_scaling(cfg: Config, rope: Config) -> Config:
    """The scaling parameters, with what they need from the rest of the config filled in
    (Phi-3's `original_max_position_embeddings` sits at the top level)."""
    original = rope.get(
        "original_max_position_embeddings", cfg.get("original_max_position_embeddings")
    )
    scaling = {**rope, "max_position_embeddings": cfg.get("max_position_embeddings", 2048)}
    return (
        scaling if original is None else {**scaling, "original_max_position_embeddings": original}
    )


def _sliding_window(cfg: Config) -> Config:
    """The window and the layers it applies to: those `layer_types` names sliding, else
    every layer from `max_window_layers` on (Qwen2 before layer types), else all."""
    window = cfg.get("sliding_window")
    if not window or cfg.get("use_sliding_window") is False:
        return {}
    num_layers, first = cfg["num_hidden_layers"], cfg.get("max_window_layers", 0)
    types = cfg.get("layer_types") or [
        "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
    ]
    layers = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
    return dict(sliding_window=window, sliding_layers=layers) if layers else {}


def _llama(cfg: Config) -> Config:
    bias = cfg.get("attention_bias", False)
    return dict(qkv_bias=bias, o_proj_bias=bias, mlp_bias=cfg.get("mlp_bias", False))


def _qwen2(cfg: Config) -> Config:
    """Qwen2/2.5: a bias on q, k and v, none on the output projection."""
    return dict(qkv_bias=cfg.get("qkv_bias", True))


def _qwen3(cfg: Config) -> Config:
    return dict(**_llama(cfg), qk_norm=True)


def _mixtral(cfg: Config) -> Config:
    """Mixtral: every layer sparse, the top-k weights renormalised (a softmax over them)."""
    moe = MoEArgs(
        num_experts=cfg["num_local_experts"],
        num_experts_per_tok=cfg["num_experts_per_tok"],
        intermediate_size=cfg["intermediate_size"],
        norm_topk_prob=True,
        layers=tuple(range(cfg["num_hidden_layers"])),
    )
    return dict(moe=moe)


def _qwen_moe(cfg: Config) -> MoEArgs:
    """Qwen2-MoE / Qwen3-MoE routing: layers sparse every `decoder_sparse_step`, except
    `mlp_only_layers`."""
    step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
    return MoEArgs(
        num_experts=cfg.get("num_experts") or cfg["num_local_experts"],  # by either name
        num_experts_per_tok=cfg["num_experts_per_tok"],
        intermediate_size=cfg["moe_intermediate_size"],
        norm_topk_prob=cfg.get("norm_topk_prob", False),
        layers=tuple(
            i for i in range(cfg["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0
        ),
        shared_intermediate_size=cfg.get("shared_expert_intermediate_size", 0),
    )


def _qwen2_moe(cfg: Config) -> Config:
    return dict(**_qwen2(cfg), moe=_qwen_moe(cfg))


def _qwen3_moe(cfg: Config) -> Config:
    return dict(**_qwen3(cfg), moe=_qwen_moe(cfg))


def _phi3(cfg: Config) -> Config:
    """Phi-3: no biases; its fused checkpoint projections are already the engine's layout."""
    return {}


def _gemma3(cfg: Config) -> Config:
    """Gemma 3 (text): GeGLU, (1 + weight) norms around both blocks and on q/k heads,
    scaled embeddings, its own attention scale, local layers with their own rotary base."""
    if cfg.get("attn_logit_softcapping"):
        raise ValueError("gemma3 with attn_logit_softcapping is not supported")
    full, local = _gemma_rope(cfg)
    scaling = {k: v for k, v in full.items() if k != "rope_theta"}
    return dict(
        hidden_act=cfg.get("hidden_activation", "gelu_pytorch_tanh"),
        qk_norm=True,
        norm_offset=1.0,
        sandwich_norms=True,
        embed_scale=cfg["hidden_size"] ** 0.5,
        query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", 256),
        final_logit_softcap=cfg.get("final_logit_softcapping"),
        rope_theta=float(full.get("rope_theta", 1_000_000.0)),
        rope_scaling=None if scaling.get("rope_type", "default") == "default" else scaling,
        local_rope_theta=float(local.get("rope_theta", 10_000.0)),
        tie_word_embeddings=cfg.get("tie_word_embeddings", True),
        **_sliding_window({**cfg, "layer_types": _gemma_layer_types(cfg)}),
        **_llama(cfg),
    )


def _gemma_layer_types(cfg: Config) -> list[str]:
    """Each layer's kind; config.json files before `layer_types` name one full-attention
    layer every `sliding_window_pattern` (6)."""
    pattern = cfg.get("sliding_window_pattern", 6)
    return cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention"
        for i in range(cfg["num_hidden_layers"])
    ]


def _gemma_rope(cfg: Config) -> tuple[Config, Config]:
    """(global, local) rotary parameters: per layer type in transformers 5's config.json,
    `rope_theta`, `rope_scaling` and `rope_local_base_freq` at the top level before."""
    per_type = cfg.get("rope_parameters") or {}
    if "full_attention" in per_type:
        return per_type["full_attention"], per_type.get("sliding_attention") or {}
    full = {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta", 1_000_000.0)}
    return full, {"rope_theta": cfg.get("rope_local_base_freq", 10_000.0)}


ARCHITECTURES: dict[str, Callable[[Config], Config]] = {
    "llama": _llama,
    "mistral": _llama,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "mixtral": _mixtral,
    "qwen2_moe": _qwen2_moe,
    "qwen3_moe": _qwen3_moe,
    "phi3": _phi3,
    "gemma3_text": _gemma3,
}
"""Each served `model_type` and how its config.json differs from Llama's."""

_ARCH_PREFIXES = {
    "llama": "Llama", "mistral": "Mistral", "qwen2_moe": "Qwen2Moe", "qwen2": "Qwen2",
    "qwen3_moe": "Qwen3Moe", "qwen3": "Qwen3", "mixtral": "Mixtral", "phi3": "Phi3",
    "gemma3_text": "Gemma3ForCausalLM",
}  # fmt: skip
"""`architectures` class-name prefixes, for a config.json without `model_type`."""
