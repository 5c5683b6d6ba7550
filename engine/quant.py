"""Weight-only INT8 / INT4 quantization: swap a model's nn.Linear modules in place.

The quantized modules are drop-in replacements (same call, same output shape),
so the model never knows (gpt-fast's way). INT8 keeps one scale per output
channel; INT4 keeps a scale and a zero per group of input channels. Round to
nearest ("rtn") quantizes the weight as it is; "awq" first searches, on
calibration activations, a per-input-channel scale (so channels that carry
large activations lose less precision) and a per-group range clip (AWQ, Lin
et al. 2023). The AWQ scale is applied to the input inside the module instead
of being folded into the previous layer, so the swap stays model-agnostic; it
costs one [M, K] multiply per call.

AWQ's search lives in engine/awq.py, checkpoints in engine/quant_checkpoint.py.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

from engine.config import QuantConfig
from engine.kernels.int4_mm import TILE_N, int4_dequantize, int4_mm_cpu, int4_mm_triton, pack_int4
from engine.kernels.int8_mm import int8_mm_cpu, int8_mm_triton

log = logging.getLogger(__name__)

MIN_GROUP_SIZE = 32
REFIT_ROUNDS = 3
ALGORITHM_VERSION = 2
"""Bumped whenever the same QuantConfig would produce different tensors (names cached files)."""


class QuantLinear(nn.Module):
    """What INT8 and INT4 share: the optional AWQ input scale, bias, and 2-D reshaping."""

    input_scale: torch.Tensor | None
    """AWQ's per-input-channel multiplier 1 / s; None for round-to-nearest."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str | None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        )
        self.register_buffer("input_scale", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features)
        if self.input_scale is not None:
            x = x * self.input_scale
        y = self.matmul(x)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantized_weight(self) -> torch.Tensor:
        """The [N, K] float weight this module computes with (input scale folded in)."""
        raise NotImplementedError

    def _fold_input_scale(self, weight: torch.Tensor) -> torch.Tensor:
        return weight if self.input_scale is None else weight * self.input_scale


class Int8Linear(QuantLinear):
    """int8 weight [N, K] with one symmetric scale per output channel."""

    qweight: torch.Tensor
    scales: torch.Tensor

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, dtype, device)
        self.register_buffer(
            "qweight", torch.empty(out_features, in_features, dtype=torch.int8, device=device)
        )
        self.register_buffer("scales", torch.empty(out_features, dtype=dtype, device=device))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        mm = int8_mm_triton if x.is_cuda else int8_mm_cpu
        return mm(x, self.qweight, self.scales)

    def dequantized_weight(self) -> torch.Tensor:
        return self._fold_input_scale(self.qweight.float() * self.scales.float()[:, None])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


class Int4Linear(QuantLinear):
    """4-bit codes packed two per byte (engine/kernels/int4_mm.py's layout), a scale
    and zero per group of `group_size` input channels."""

    qweight: torch.Tensor
    scales_and_zeros: torch.Tensor

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group_size: int,
        bias: bool = False,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, dtype, device)
        self.group_size = group_size
        num_groups = in_features // group_size
        self.register_buffer(
            "qweight", torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=device)
        )
        self.register_buffer(
            "scales_and_zeros", torch.empty(num_groups, out_features, 2, dtype=dtype, device=device)
        )

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        mm = int4_mm_triton if x.is_cuda else int4_mm_cpu
        return mm(x, self.qweight, self.scales_and_zeros, self.group_size)

    def dequantized_weight(self) -> torch.Tensor:
        weight = int4_dequantize(
            self.qweight, self.scales_and_zeros.float(), self.group_size, torch.float32
        )
        return self._fold_input_scale(weight)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int4, group_size={self.group_size}"
        )


# ---- quantization maths -------------------------------------------------------------


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


def group_size_for(in_features: int, requested: int) -> int | None:
    """The largest power-of-two group <= requested that divides K (576 allows 64, not 128)."""
    size = requested
    while size >= MIN_GROUP_SIZE:
        if in_features % size == 0:
            return size
        size //= 2
    return None


def quantize_linear(
    linear: nn.Linear, scheme: str, group_size: int, awq: AwqParams | None = None
) -> QuantLinear:
    """The quantized twin of `linear`; with `awq`, the weight is multiplied by s = 1 /
    input_scale before quantizing, each group's range shrunk by `awq.clip`, and
    INT4 scales and zeros refitted with `awq.importance`."""
    n, k = linear.out_features, linear.in_features
    dtype, device = linear.weight.dtype, linear.weight.device
    weight = linear.weight.detach().float()
    clip = importance = None
    if awq is not None:
        weight, clip, importance = weight / awq.input_scale.float(), awq.clip, awq.importance
    module: QuantLinear
    if scheme == "int8":
        module = Int8Linear(k, n, False, dtype, device)
        codes, scales = quantize_int8(weight, clip)
        module.qweight.copy_(codes)
        module.scales.copy_(scales)
    else:
        module = Int4Linear(k, n, group_size, False, dtype, device)
        codes, scales, zeros = int4_codes(weight, group_size, clip, importance)
        module.qweight.copy_(pack_int4(codes))
        module.scales_and_zeros.copy_(torch.stack([scales.t(), zeros.t()], dim=-1))
    if linear.bias is not None:
        module.bias = nn.Parameter(linear.bias.detach().clone())
    if awq is not None:
        module.input_scale = awq.input_scale.to(dtype)
    return module


class AwqParams(NamedTuple):
    """What AWQ's search found for one layer (engine/awq.py)."""

    input_scale: torch.Tensor
    """[K]: 1 / s, multiplied into the input; the weight is multiplied by s."""
    clip: torch.Tensor
    """[N, G]: shrink factor of each group's range (G = 1 for INT8)."""
    importance: torch.Tensor
    """[K]: mean squared scaled input per channel, the weights of INT4's scale/zero refit."""


# ---- the model-level swap ------------------------------------------------------------


def quantize_model(
    model: nn.Module, config: QuantConfig, calibration: Sequence[torch.Tensor] = ()
) -> nn.Module:
    """Replace every eligible nn.Linear of `model` in place and return it.

    `calibration` (token-id sequences) is needed by method "awq": the model must
    expose `compute_logits_dense(token_ids)`. Layers whose shape the scheme
    cannot take (INT4 needs N % 64 == 0 and a group of >= 32 dividing K) stay
    as they are, with a warning.
    """
    plan = quantization_plan(model, config)
    found: dict[str, AwqParams] = {}
    if config.method == "awq":
        if not calibration:
            raise ValueError(
                "quant.method 'awq' needs calibration token ids (engine.awq.calibration_token_ids)"
            )
        from engine.awq import search_model  # awq builds on this module's maths

        found = search_model(model, plan, config.scheme, calibration)
    for name, group_size in plan.items():
        linear = model.get_submodule(name)
        assert isinstance(linear, nn.Linear)
        qlinear = quantize_linear(linear, config.scheme, group_size, found.get(name))
        set_submodule(model, name, qlinear)
    return model


def quantization_plan(model: nn.Module, config: QuantConfig) -> dict[str, int]:
    """Module name -> group size (0 for INT8) of every Linear that will be quantized."""
    plan: dict[str, int] = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if name.rsplit(".", 1)[-1] == "lm_head" and not config.quantize_lm_head:
            continue
        group_size = _eligible_group_size(module, config)
        if group_size is None:
            log.warning(
                "quant: leaving %s (%dx%d) unquantized: shape not supported by %s",
                name,
                module.out_features,
                module.in_features,
                config.scheme,
            )
            continue
        plan[name] = group_size
    return plan


def _eligible_group_size(linear: nn.Linear, config: QuantConfig) -> int | None:
    if config.scheme == "int8":
        return 0
    if linear.out_features % TILE_N:
        return None
    return group_size_for(linear.in_features, config.group_size)


def set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)
