"""The arithmetic of weight quantization, shared by the Linear swap and AWQ's search.

INT8: symmetric, one scale per output channel. INT4: asymmetric, a scale and a
zero per group of input channels, optionally refitted by weighted least
squares. `fake_quantize` gives the weight a quantized module computes with, so
AWQ can score candidate scales without building modules.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

MIN_GROUP_SIZE = 32
REFIT_ROUNDS = 3


class AwqParams(NamedTuple):
    """What AWQ's search found for one layer (engine/awq.py)."""

    input_scale: torch.Tensor
    """[K]: 1 / s, multiplied into the input; the weight is multiplied by s."""
    clip: torch.Tensor
    """[N, G]: shrink factor of each group's range (G = 1 for INT8)."""
    importance: torch.Tensor
    """[K]: mean squared scaled input per channel, the weights of INT4's scale/zero refit."""


def quantize_int8(
    weight: torch.Tensor, clip: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per output channel: weight [N, K] -> (int8 codes [N, K], fp32 scales [N]).

    `clip` [N, 1] shrinks each channel's range (AWQ's clipping search).
    """
    absmax = weight.float().abs().amax(dim=1)
    if clip is not None:
        absmax = absmax * clip.view(-1)
    scales = absmax.clamp(min=1e-8) / 127
    codes = torch.round(weight.float() / scales[:, None]).clamp(-128, 127).to(torch.int8)
    return codes, scales


def int4_codes(
    weight: torch.Tensor,
    group_size: int,
    clip: torch.Tensor | None = None,
    importance: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric per group: weight [N, K] -> (codes [N, K] in 0..15, scales [N, G], zeros [N, G]).

    The range [min, max] of each group (times `clip` [N, G] if given) maps onto
    the 16 codes; code q means (q - 8) * scale + zero, so zero is code 8's value.
    With `importance` [K] (mean squared input per channel), scale and zero are
    then refitted to the codes by weighted least squares, a few rounds.
    """
    n, k = weight.shape
    groups = weight.float().view(n, k // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    if clip is not None:
        low, high = low * clip, high * clip
    scales = ((high - low) / 15).clamp(min=1e-8)
    zeros = low + 8 * scales
    codes = _round_int4(groups, scales, zeros)
    if importance is not None:
        weights = importance.float().view(1, k // group_size, group_size)
        for _ in range(REFIT_ROUNDS):
            scales, zeros = _refit(groups, codes.float() - 8, weights, scales, zeros)
            codes = _round_int4(groups, scales, zeros)
    return codes.to(torch.uint8).view(n, k), scales, zeros


def _round_int4(groups: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    return torch.round((groups - zeros[..., None]) / scales[..., None] + 8).clamp(0, 15)


def _refit(
    groups: torch.Tensor,
    centred: torch.Tensor,
    weights: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """argmin over (s, z) of sum_k h_k (w_k - s c_k - z)^2 per group: a 2x2 normal equation."""
    sum_h = weights.sum(-1)
    sum_c, sum_cc = (weights * centred).sum(-1), (weights * centred * centred).sum(-1)
    sum_w, sum_cw = (weights * groups).sum(-1), (weights * centred * groups).sum(-1)
    det = (sum_cc * sum_h - sum_c * sum_c).clamp(min=1e-12)
    new_scales = (sum_cw * sum_h - sum_c * sum_w) / det
    new_zeros = (sum_w - new_scales * sum_c) / sum_h
    usable = new_scales > 1e-8  # a group whose codes collapsed keeps its fit
    return torch.where(usable, new_scales, scales), torch.where(usable, new_zeros, zeros)


def fake_quantize(
    weight: torch.Tensor, scheme: str, group_size: int, clip: torch.Tensor | None = None
) -> torch.Tensor:
    """Quantize then de-quantize in fp32: the weight a quantized module would compute with."""
    if scheme == "int8":
        codes, scales = quantize_int8(weight, clip)
        return codes.float() * scales[:, None]
    codes, scales, zeros = int4_codes(weight, group_size, clip)
    n, k = weight.shape
    grouped = codes.float().view(n, k // group_size, group_size)
    return ((grouped - 8) * scales[..., None] + zeros[..., None]).view(n, k)


def scheme_of(group_size: int) -> str:
    """The scheme a quantization plan's entry stands for: group 0 is INT8 (per channel),
    any other is INT4 with groups of that size."""
    return "int8" if group_size == 0 else "int4"


def group_size_for(in_features: int, requested: int) -> int | None:
    """The largest power-of-two group <= requested that divides K (576 allows 64, not 128)."""
    size = requested
    while size >= MIN_GROUP_SIZE:
        if in_features % size == 0:
            return size
        size //= 2
    return None
