"""Rotary position embeddings: frequencies (with each checkpoint's scaling), tables, rotation.

The tables are built once for every position the model serves and indexed by
absolute position, so a step's rotation is one lookup shared by every layer,
whatever the mix of prefill chunks and decodes in it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from engine.model.args import ModelArgs

Rotation = tuple[torch.Tensor, torch.Tensor]
"""(cos, sin) at a step's positions, each [T, 1, head_dim]."""


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] of rotary embeddings, with linear or llama3 scaling
    applied (longrope's divisors depend on the position: `position_freqs` applies them)."""
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = args.rope_scaling
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if scaling is None or kind == "longrope":
        return inv_freq.float()
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float()
    if kind == "llama3":
        return _llama3_scaled(inv_freq, scaling).float()
    raise ValueError(
        f"rope scaling {kind!r} is not supported (default, linear, llama3, longrope are)"
    )


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


def _longrope_factors(s: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Phi-3's LongRoPE: per-frequency divisors for positions inside the pretraining
    context (short) and past it (long), and the cos/sin gain for the longer context."""
    original = s["original_max_position_embeddings"]
    factor = s.get("factor") or s["max_position_embeddings"] / original
    gain = s.get("attention_factor")
    if gain is None:
        gain = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    short = torch.tensor(s["short_factor"], dtype=torch.float64)
    return short, torch.tensor(s["long_factor"], dtype=torch.float64), gain


def position_freqs(args: ModelArgs, max_len: int) -> tuple[torch.Tensor, float]:
    """Angles [max_len, head_dim / 2] of every position, and the cos/sin gain.

    LongRoPE picks its set per position (long past the pretraining context):
    transformers picks it per forward call from the longest position in it, which
    would change a cached prefix's keys when a sequence crosses that length.
    """
    positions = torch.arange(max_len, dtype=torch.float32)
    scaling = args.rope_scaling
    inv_freq = rope_inv_freq(args)
    if scaling is None or scaling.get("rope_type", scaling.get("type")) != "longrope":
        return torch.outer(positions, inv_freq), 1.0
    short, long, gain = _longrope_factors(scaling)
    is_long = positions >= scaling["original_max_position_embeddings"]  # [max_len]
    freqs = torch.where(
        is_long[:, None],
        torch.outer(positions, (inv_freq / long).float()),
        torch.outer(positions, (inv_freq / short).float()),
    )
    return freqs, gain


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables, indexed by absolute position (HF's rotate-half layout)."""

    def __init__(self, args: ModelArgs, max_len: int) -> None:
        super().__init__()
        freqs, gain = position_freqs(args, max_len)
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_len, head_dim]
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", emb.cos() * gain, persistent=False)  # a gain of 1 is exact
        self.register_buffer("sin", emb.sin() * gain, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotation:
        """cos/sin at these positions, looked up once per forward and shared by all layers."""
        cos = self.cos[positions].unsqueeze(1).to(dtype)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1).to(dtype)
        return cos, sin


def rotate(x: torch.Tensor, rotation: Rotation) -> torch.Tensor:
    """Apply rotary embeddings to `x` [T, H, D] (the rotate-half layout)."""
    cos, sin = rotation
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
