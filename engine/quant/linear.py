"""INT8 / INT4 quantization: swap a model's nn.Linear modules in place.

The quantized modules are drop-in replacements (same call, same output shape),
so the model never knows (gpt-fast's way). INT8 keeps one scale per output
channel; INT4 keeps a scale and a zero per group of input channels. Round to
nearest ("rtn") quantizes the weight as it is; "awq" first searches, on
calibration activations, a per-input-channel scale (so channels that carry
large activations lose less precision) and a per-group range clip (AWQ, Lin
et al. 2023). The AWQ scale is applied to the input inside the module instead
of being folded into the previous layer, so the swap stays model-agnostic; it
costs one [M, K] multiply per call. A layer computes with float activations
(weight-only) until `switch_to_int8_activations` moves it to the integer kernels
(W4A8 / W8A8). A mixed-precision INT4 config keeps some layers at INT8
(`QuantConfig.int8_layers`): a plan maps each layer to its group, 0 meaning INT8.

The maths lives in engine/quant/maths.py, AWQ's search in engine/quant/awq.py, the
model-level swap with caching in engine/quant/prepare.py.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from engine.config import QuantConfig
from engine.kernels import w4a8
from engine.kernels.int4_mm import TILE_N, int4_dequantize, int4_mm_cpu, int4_mm_triton, pack_int4
from engine.kernels.int8_mm import int8_mm_cpu, int8_mm_triton
from engine.quant.maths import AwqParams, group_size_for, int4_codes, quantize_int8

log = logging.getLogger(__name__)

W8A8_GROUP_SIZE = 64
"""Inputs per activation scale when an INT8 layer computes with int8 activations."""
ALGORITHM_VERSION = 2
"""Bumped whenever the same QuantConfig would produce different tensors (names cached files)."""


class QuantLinear(nn.Module):
    """What INT8 and INT4 share: the optional AWQ input scale, bias, and 2-D reshaping."""

    input_scale: torch.Tensor | None
    """AWQ's per-input-channel multiplier 1 / s; None for round-to-nearest."""
    a8_weight: w4a8.A8Weight | None = None
    """The weight in the integer kernels' layout once `use_int8_activations` has switched
    the layer over (a copy beside the codes the checkpoint and the other paths read)."""

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
        """Same call and output shape as the nn.Linear it replaced."""
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features)
        if self.input_scale is not None:
            x = x * self.input_scale
        use_kernel = self.a8_weight is not None and not x.is_cuda
        y = w4a8.a8_mm(x, self.a8_weight) if use_kernel else self.matmul(x)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] times the quantized weight, activations in float: the scheme's kernel."""
        raise NotImplementedError

    def dequantized_weight(self) -> torch.Tensor:
        """The [N, K] float weight this module computes with (input scale folded in)."""
        raise NotImplementedError

    def use_int8_activations(self) -> None:
        """Quantize inputs to int8 and run integer dot products (w4a8.c) from now on."""
        raise NotImplementedError

    def takes_int8_activations(self) -> bool:
        """The integer kernel takes this layer's shape."""
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
        """x [M, K] @ W^T through the INT8 weight-only matmul (CPU, Triton or reference)."""
        mm = int8_mm_triton if x.is_cuda else int8_mm_cpu
        return mm(x, self.qweight, self.scales)

    def use_int8_activations(self) -> None:
        """W8A8, activations quantized per group of `W8A8_GROUP_SIZE` inputs (or fewer)."""
        group = group_size_for(self.in_features, W8A8_GROUP_SIZE)
        assert group is not None, "check takes_int8_activations() first"
        self.a8_weight = w4a8.repack_int8(self.qweight, self.scales, group)

    def takes_int8_activations(self) -> bool:
        """The W8A8 kernel takes this shape."""
        group = group_size_for(self.in_features, W8A8_GROUP_SIZE)
        return group is not None and w4a8.supports(self.out_features, self.in_features, group)

    def dequantized_weight(self) -> torch.Tensor:
        """The fp weight this module computes with: for quality checks and tests."""
        return self._fold_input_scale(self.qweight.float() * self.scales.float()[:, None])

    def extra_repr(self) -> str:
        """Shapes and scheme, for printing the model."""
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
        """x [M, K] @ W^T through the INT4 group-wise weight-only matmul (CPU, Triton or
        reference)."""
        mm = int4_mm_triton if x.is_cuda else int4_mm_cpu
        return mm(x, self.qweight, self.scales_and_zeros, self.group_size)

    def use_int8_activations(self) -> None:
        """W4A8, activations quantized per weight group."""
        self.a8_weight = w4a8.repack(self.qweight, self.scales_and_zeros, self.group_size)

    def takes_int8_activations(self) -> bool:
        """The W4A8 kernel takes this shape."""
        return w4a8.supports(self.out_features, self.in_features, self.group_size)

    def dequantized_weight(self) -> torch.Tensor:
        """The fp weight this module computes with: for quality checks and tests."""
        weight = int4_dequantize(
            self.qweight, self.scales_and_zeros.float(), self.group_size, torch.float32
        )
        return self._fold_input_scale(weight)

    def extra_repr(self) -> str:
        """Shapes, scheme and group size, for printing the model."""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int4, group_size={self.group_size}"
        )


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


def switch_to_int8_activations(model: nn.Module) -> int:
    """Have every quantized layer whose shape the integer kernels take compute with int8
    activations; how many were switched (none where the kernels do not build here)."""
    if not w4a8.available():
        log.warning("quant.activations int8: no W4A8 kernel here, layers stay weight-only")
        return 0
    layers = [
        m for m in model.modules() if isinstance(m, QuantLinear) and m.takes_int8_activations()
    ]
    for layer in layers:
        layer.use_int8_activations()
    return len(layers)


# ---- which layers ---------------------------------------------------------------------


ROUTER_LAYERS = ("gate", "shared_expert_gate")
"""A mixture of experts' routers (engine.model.moe) stay in the model's dtype: they choose
which experts run, a discrete decision, and are a sliver of the weights. At INT8 the
top-2 choice of a tiny Mixtral agreed with fp32 at 96.7% of positions."""


def quantization_plan(model: nn.Module, config: QuantConfig) -> dict[str, int]:
    """Module name -> group size (0 for INT8) of every Linear that will be quantized."""
    plan: dict[str, int] = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        kind = name.rsplit(".", 1)[-1]
        if kind == "lm_head" and not config.quantize_lm_head or kind in ROUTER_LAYERS:
            continue
        group_size = 0 if kind in config.int8_layers else _eligible_group_size(module, config)
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
    unmatched = set(config.int8_layers) - {name.rsplit(".", 1)[-1] for name in plan}
    if unmatched:
        raise ValueError(f"quant.int8_layers {sorted(unmatched)} name no Linear of this model")
    return plan


def _eligible_group_size(linear: nn.Linear, config: QuantConfig) -> int | None:
    if config.scheme == "int8":
        return 0
    if linear.out_features % TILE_N:
        return None
    return group_size_for(linear.in_features, config.group_size)


def set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    """Replace the submodule at dotted path `name` with `module`."""
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)
