"""Llama-family decoder over a packed batch, reading and writing a paged KV cache.

Plain eager PyTorch in the gpt-fast tone: every projection is an `nn.Linear`
called as `linear(x)`, so quantization can swap the modules without the
model knowing. Q/K/V and gate/up are fused into one matmul each because at
batch 1 on a CPU the per-call overhead of small matmuls is not free.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import rope
from engine.kernels.rms_norm import add_rms_norm, rms_norm
from engine.model.attention import AttentionMetadata, paged_attention


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
    attention_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArgs:
        """Read a Llama-family config.json (transformers 4.x or 5.x rope layout)."""
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        if cfg.get("model_type", "llama") not in ("llama", "mistral", "qwen2") and not any(
            "Llama" in a for a in archs
        ):
            raise ValueError(f"unsupported architecture {archs}: a Llama-family model is needed")
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = float(cfg.get("rope_theta") or rope.pop("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=None if rope_type == "default" else rope,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", False),
            mlp_bias=cfg.get("mlp_bias", False),
        )


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies of rotary embeddings, with linear or llama3 scaling applied."""
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = args.rope_scaling
    if scaling is None:
        return inv_freq.float()
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float()
    if kind == "llama3":
        return _llama3_scaled(inv_freq, scaling).float()
    raise ValueError(f"rope scaling {kind!r} is not supported (default, linear, llama3 are)")


def _llama3_scaled(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's rule: long wavelengths are divided by `factor`, short ones kept,
    and the band between is interpolated smoothly."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(is_mid, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables, indexed by absolute position (HF's rotate-half layout)."""

    def __init__(self, args: ModelArgs, max_len: int) -> None:
        super().__init__()
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), rope_inv_freq(args))
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_len, head_dim]
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotation:
        """cos/sin at these positions, looked up once per forward and shared by all layers."""
        cos = self.cos[positions].unsqueeze(1).to(dtype)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1).to(dtype)
        return cos, sin


Rotation = tuple[torch.Tensor, torch.Tensor]
LayerKV = tuple[torch.Tensor, torch.Tensor] | None
"""One layer's (k_cache, v_cache), each [num_slots, kv_heads, head_dim]; None: no cache."""


def rotate(x: torch.Tensor, rotation: Rotation) -> torch.Tensor:
    """Apply rotary embeddings to `x` [T, H, D] (the rotate-half layout)."""
    cos, sin = rotation
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in fp32 like the reference."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised `x` (in fp32, as the reference does), scaled by the learned weight."""
        return rms_norm(x, self.weight, self.eps)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): a skip connection and this norm, fused."""
        return add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    """Grouped-query self-attention with one fused QKV projection."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = args.num_heads, args.num_kv_heads
        self.head_dim = args.head_dim
        self.q_size = args.num_heads * args.head_dim
        self.kv_size = args.num_kv_heads * args.head_dim
        self.qkv_proj = nn.Linear(
            args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, args.hidden_size, bias=args.attention_bias)

    def forward(
        self, x: torch.Tensor, rotation: Rotation, meta: AttentionMetadata | None, kv: LayerKV
    ) -> torch.Tensor:
        """Attention output [T, hidden] for packed tokens [T, hidden]."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        rotated = rope.rotate_in_place(qkv, *rotation, self.num_heads + self.num_kv_heads,
                                       self.head_dim)  # fmt: skip
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if not rotated:
            q, k = rotate(q, rotation), rotate(k, rotation)
        if meta is None or kv is None:
            out = _dense_causal_attention(q, k, v)
        else:
            out = paged_attention(q, k, v, kv[0], kv[1], meta)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


def _dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of one sequence over itself, no cache: for calibration and tests."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
    )  # [H, T, D]
    return out.transpose(0, 1)


class MLP(nn.Module):
    """SwiGLU feed-forward with one fused gate/up projection."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.intermediate_size = args.intermediate_size
        self.gate_up_proj = nn.Linear(
            args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias
        )
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate(x)) * up(x))."""
        gate_up = self.gate_up_proj(x)
        gate, up = gate_up[..., : self.intermediate_size], gate_up[..., self.intermediate_size :]
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))  # in the fresh projection


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: attention then MLP, each around a residual.

    The residual stream travels as a pair: what the previous block added, and the stream
    before it. Each norm does the add before it (RMSNorm.add_and_norm, one fused call)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rotation: Rotation,
        meta: AttentionMetadata | None,
        kv: LayerKV,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this block's addition, the stream before it) for packed hidden states [T,
        hidden]: `x` is the previous block's addition to `residual` (None: `x` is the
        embeddings)."""
        if residual is None:
            normed, residual = self.input_layernorm(x), x
        else:
            normed, residual = self.input_layernorm.add_and_norm(x, residual)
        attended = self.self_attn(normed, rotation, meta, kv)
        normed, residual = self.post_attention_layernorm.add_and_norm(attended, residual)
        return self.mlp(normed), residual


class LlamaForCausalLM(nn.Module):
    """The whole decoder: embeddings, layers, final norm and output head."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.rope = RotaryEmbedding(args, args.max_position_embeddings)

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata | None = None,
        kv_caches: Sequence[LayerKV] = (),
    ) -> torch.Tensor:
        """Hidden states [T, hidden] for packed tokens [T], reading and writing `kv_caches`
        (one per layer, owned by the caller); `meta=None` means one sequence attending
        to itself without a cache."""
        x = self.embed_tokens(input_ids)
        if meta is None:
            positions = torch.arange(input_ids.shape[0], device=input_ids.device)
        else:
            positions = meta.positions
        rotation = self.rope(positions, x.dtype)
        caches = kv_caches or [None] * len(self.layers)
        residual = None
        for layer, kv in zip(self.layers, caches, strict=True):
            x, residual = layer(x, residual, rotation, meta, kv)
        return self.norm(x) if residual is None else self.norm.add_and_norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits for the rows that are sampled (computing them for every
        prefill token would waste a vocab-sized matmul per token)."""
        return self.lm_head(hidden).float()

    def compute_logits_dense(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab] of one sequence, no KV cache: quality metrics, calibration."""
        return self.compute_logits(self.forward(token_ids))

    def load_hf_state_dict(self, hf_state: dict[str, torch.Tensor]) -> None:
        """Load HF Llama tensor names, fusing q/k/v and gate/up as this model expects."""
        state = {_strip(name): t for name, t in hf_state.items() if self._wants(_strip(name))}
        for i in range(self.args.num_layers):
            attn, mlp = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
            _fuse(state, attn + "qkv_proj", [attn + f"{p}_proj" for p in "qkv"])
            _fuse(state, mlp + "gate_up_proj", [mlp + "gate_proj", mlp + "up_proj"])
        if self.args.tie_word_embeddings:
            state.pop("lm_head.weight", None)
            state["lm_head.weight"] = state["embed_tokens.weight"]
        missing, unexpected = self.load_state_dict(state, strict=False, assign=True)
        if missing or unexpected:
            raise ValueError(f"checkpoint mismatch: missing {missing}, unexpected {unexpected}")
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.reset_rope()

    def reset_rope(self) -> None:
        """Rebuild the rotary tables: checkpoints do not hold them, and a model made on
        the meta device has only empty placeholders."""
        self.rope = RotaryEmbedding(self.args, self.args.max_position_embeddings)

    def _wants(self, name: str) -> bool:
        """Skip rotary buffers and layers past `num_layers` (a truncated draft)."""
        if "rotary_emb" in name:
            return False
        return not name.startswith("layers.") or int(name.split(".")[1]) < self.args.num_layers


def _strip(name: str) -> str:
    return name.removeprefix("model.")


def _fuse(state: dict[str, torch.Tensor], target: str, parts: list[str]) -> None:
    for suffix in ("weight", "bias"):
        keys = [f"{p}.{suffix}" for p in parts]
        if all(k in state for k in keys):
            state[f"{target}.{suffix}"] = torch.cat([state.pop(k) for k in keys], dim=0)
