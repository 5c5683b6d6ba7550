"""Llama-family decoder over a packed batch, reading and writing a paged KV cache.

Plain eager PyTorch in the gpt-fast tone: every projection is an `nn.Linear`
called as `linear(x)`, so quantization can swap the modules without the
model knowing. Q/K/V and gate/up are fused into one matmul each because at
batch 1 on a CPU the per-call overhead of small matmuls is not free.

One decoder serves every architecture engine.model.args reads (Llama, Mistral,
Qwen2/3, Mixtral, Qwen-MoE, Phi-3, Gemma 3): their differences are fields of
ModelArgs (biases, q/k norms, a sparse feed-forward, rotary scaling, Gemma's extra
norms and scales), not subclasses; on Llama's own path each costs one `if`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import rope
from engine.kernels.rms_norm import add_rms_norm, rms_norm
from engine.model.args import ModelArgs
from engine.model.attention import AttentionMetadata, paged_attention
from engine.model.hf_names import engine_state_dict
from engine.model.mlp import MLP
from engine.model.moe import SparseMoE
from engine.model.rotary import RotaryEmbedding, Rotation, rotate

LayerKV = tuple[torch.Tensor, torch.Tensor] | None
"""One layer's (k_cache, v_cache), each [num_slots, kv_heads, head_dim]; None: no cache."""


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

    def __init__(self, args: ModelArgs, index: int) -> None:
        super().__init__()
        self.window = args.sliding_window if index in args.sliding_layers else None
        self.num_heads, self.num_kv_heads = args.num_heads, args.num_kv_heads
        self.head_dim = args.head_dim
        self.q_size = args.num_heads * args.head_dim
        self.kv_size = args.num_kv_heads * args.head_dim
        self.qkv_proj = nn.Linear(
            args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, args.hidden_size, bias=args.o_proj_bias)
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        # Scales q so that the kernels' 1/sqrt(head_dim) becomes the model's 1/sqrt(scalar).
        scalar = args.query_pre_attn_scalar
        self.q_scale = None if scalar in (None, args.head_dim) else (args.head_dim / scalar) ** 0.5

    def forward(
        self, x: torch.Tensor, rotation: Rotation, meta: AttentionMetadata | None, kv: LayerKV
    ) -> torch.Tensor:
        """Attention output [T, hidden] for packed tokens [T, hidden]."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        if self.q_norm is not None:
            qkv = self._norm_heads(qkv)
        rotated = rope.rotate_in_place(qkv, *rotation, self.num_heads + self.num_kv_heads,
                                       self.head_dim)  # fmt: skip
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if not rotated:
            q, k = rotate(q, rotation), rotate(k, rotation)
        if self.q_scale is not None:
            q = q * self.q_scale
        if meta is None or kv is None:
            out = _dense_causal_attention(q, k, v, self.window)
        else:
            out = paged_attention(q, k, v, kv[0], kv[1], meta, self.window)
        return self.o_proj(out.reshape(num_tokens, self.q_size))

    def _norm_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv with each q and k head RMS-normalised (Qwen3), before the rotation."""
        assert self.q_norm is not None and self.k_norm is not None
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim))  # [T, H, D]
        k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim))
        return torch.cat([q.view(num_tokens, -1), k.view(num_tokens, -1), v], dim=-1)


def _dense_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None
) -> torch.Tensor:
    """Attention of one sequence over itself, no cache: for calibration and tests."""
    q_t, k_t, v_t = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, T, D]
    num_tokens = q.shape[0]
    if window is None or num_tokens <= window:
        out = F.scaled_dot_product_attention(q_t, k_t, v_t, is_causal=True, enable_gqa=True)
    else:
        pos = torch.arange(num_tokens, device=q.device)
        visible = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
        out = F.scaled_dot_product_attention(q_t, k_t, v_t, attn_mask=visible, enable_gqa=True)
    return out.transpose(0, 1)


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: attention then MLP, each around a residual.

    The residual stream travels as a pair: what the previous block added, and the stream
    before it. Each norm does the add before it (RMSNorm.add_and_norm, one fused call).
    With sandwich norms (Gemma) each block's output is normalised before it is added."""

    def __init__(self, args: ModelArgs, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, index)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp: MLP | SparseMoE
        if args.moe is not None and index in args.moe.layers:
            self.mlp = SparseMoE(args.hidden_size, args.moe)
        else:
            self.mlp = MLP(args.hidden_size, args.intermediate_size, args.mlp_bias, args.hidden_act)
        sandwich = args.sandwich_norms
        self.attn_out_norm = RMSNorm(args.hidden_size, args.rms_norm_eps) if sandwich else None
        self.mlp_out_norm = RMSNorm(args.hidden_size, args.rms_norm_eps) if sandwich else None

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
        if self.attn_out_norm is not None:
            attended = self.attn_out_norm(attended)
        normed, residual = self.post_attention_layernorm.add_and_norm(attended, residual)
        out = self.mlp(normed)
        return (out if self.mlp_out_norm is None else self.mlp_out_norm(out)), residual


class LlamaForCausalLM(nn.Module):
    """The whole decoder: embeddings, layers, final norm and output head."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.rope: RotaryEmbedding
        self.local_rope: RotaryEmbedding | None
        self.reset_rope()

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata | None = None,
        kv_caches: Sequence[LayerKV] = (),
    ) -> torch.Tensor:
        """Hidden states [T, hidden] for packed tokens [T], reading and writing `kv_caches`
        (one per layer, owned by the caller); `meta=None` means one sequence attending
        to itself without a cache."""
        x = self.embed_tokens(input_ids)  # [T, hidden]
        if self.args.embed_scale != 1.0:
            x = x * torch.tensor(self.args.embed_scale, dtype=x.dtype)
        if meta is None:
            positions = torch.arange(input_ids.shape[0], device=input_ids.device)
        else:
            positions = meta.positions
        caches = kv_caches or [None] * len(self.layers)
        residual = None
        for layer, kv, rotation in zip(
            self.layers, caches, self._rotations(positions, x.dtype), strict=True
        ):
            x, residual = layer(x, residual, rotation, meta, kv)
        return self.norm(x) if residual is None else self.norm.add_and_norm(x, residual)[0]

    def _rotations(self, positions: torch.Tensor, dtype: torch.dtype) -> list[Rotation]:
        """Each layer's cos/sin at `positions`, looked up once per table for all layers."""
        rotation = self.rope(positions, dtype)
        if self.local_rope is None:
            return [rotation] * len(self.layers)
        local = self.local_rope(positions, dtype)
        sliding = self.args.sliding_layers
        return [local if i in sliding else rotation for i in range(len(self.layers))]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits for the rows that are sampled (computing them for every
        prefill token would waste a vocab-sized matmul per token), soft-capped where the
        model is."""
        logits = self.lm_head(hidden).float()  # [N, vocab]
        cap = self.args.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def compute_logits_dense(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab] of one sequence, no KV cache: quality metrics, calibration."""
        return self.compute_logits(self.forward(token_ids))

    def load_hf_state_dict(self, hf_state: dict[str, torch.Tensor]) -> None:
        """Load a checkpoint's tensors (transformers' names), fused as this model expects."""
        self.load_engine_state(engine_state_dict(hf_state, self.args))

    def load_engine_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load tensors under the engine's names (every one the model holds), assigned in
        place (the model may be a meta-device skeleton)."""
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
        args, max_len = self.args, self.args.max_position_embeddings
        self.rope = RotaryEmbedding(args, max_len)
        self.local_rope = None
        if args.local_rope_theta is not None:
            local = dataclasses.replace(args, rope_theta=args.local_rope_theta, rope_scaling=None)
            self.local_rope = RotaryEmbedding(local, max_len)
