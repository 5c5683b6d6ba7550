"""Weight-only INT8 / INT4 quantization: swap a model's nn.Linear modules in place.

The quantized modules are drop-in replacements (same call, same output shape),
so the model never knows (gpt-fast's way). INT8 keeps one scale per output
channel; INT4 keeps a scale and a zero per group of input channels. Round to
nearest ("rtn") quantizes the weight as it is; "awq" first searches a
per-input-channel scale on calibration activations so that the channels that
carry large activations lose less precision (AWQ, Lin et al. 2023). The AWQ
scale is applied to the input inside the module instead of being folded into
the previous layer, so the swap stays model-agnostic; it costs one [M, K]
multiply per call.

Quantized models are saved as one safetensors file (all tensors plus metadata
and a checksum) and loaded without touching the original weights.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from engine.config import QuantConfig
from engine.kernels.int4_mm import TILE_N, int4_dequantize, int4_mm_cpu, int4_mm_triton, pack_int4
from engine.kernels.int8_mm import int8_mm_cpu, int8_mm_triton

log = logging.getLogger(__name__)

FORMAT = "tierserve-quant"
FORMAT_VERSION = "1"
MIN_GROUP_SIZE = 32
AWQ_GRID = 20
AWQ_MAX_TOKENS = 512
DEFAULT_CALIBRATION_PATH = Path(__file__).resolve().parents[1] / "data" / "quality_prompts.jsonl"


class QuantLinear(nn.Module):
    """What INT8 and INT4 share: the optional AWQ input scale, bias, and 2-D reshaping."""

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
        kwargs = {"dtype": dtype, "device": device}
        self.bias = nn.Parameter(torch.empty(out_features, **kwargs)) if bias else None
        # AWQ's per-input-channel multiplier 1 / s; None for round-to-nearest.
        self.input_scale: torch.Tensor | None
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


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel: weight [N, K] -> (int8 codes [N, K], fp32 scales [N])."""
    scales = weight.float().abs().amax(dim=1).clamp(min=1e-8) / 127
    codes = torch.round(weight.float() / scales[:, None]).clamp(-128, 127).to(torch.int8)
    return codes, scales


def int4_codes(
    weight: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric per group: weight [N, K] -> (codes [N, K] in 0..15, scales [N, G], zeros [N, G]).

    The range [min, max] of each group maps onto the 16 codes; code q means
    (q - 8) * scale + zero, so zero is the value of code 8.
    """
    n, k = weight.shape
    groups = weight.float().view(n, k // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((high - low) / 15).clamp(min=1e-8)
    codes = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15)
    return codes.to(torch.uint8).view(n, k), scales, low + 8 * scales


def fake_quantize(weight: torch.Tensor, scheme: str, group_size: int) -> torch.Tensor:
    """Quantize then de-quantize in fp32: the weight a quantized module would compute with."""
    if scheme == "int8":
        codes, scales = quantize_int8(weight)
        return codes.float() * scales[:, None]
    codes, scales, zeros = int4_codes(weight, group_size)
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
    linear: nn.Linear, scheme: str, group_size: int, input_scale: torch.Tensor | None = None
) -> QuantLinear:
    """The quantized twin of `linear`; `input_scale` is AWQ's 1 / s (weight is multiplied by s)."""
    n, k = linear.out_features, linear.in_features
    dtype, device = linear.weight.dtype, linear.weight.device
    weight = linear.weight.detach().float()
    if input_scale is not None:
        weight = weight / input_scale.float()
    has_bias = linear.bias is not None
    module: QuantLinear
    if scheme == "int8":
        module = Int8Linear(k, n, has_bias, dtype, device)
        codes, scales = quantize_int8(weight)
        module.qweight.copy_(codes)
        module.scales.copy_(scales)
    else:
        module = Int4Linear(k, n, group_size, has_bias, dtype, device)
        codes, scales, zeros = int4_codes(weight, group_size)
        module.qweight.copy_(pack_int4(codes))
        module.scales_and_zeros.copy_(torch.stack([scales.t(), zeros.t()], dim=-1))
    if has_bias:
        module.bias.data.copy_(linear.bias.detach())
    if input_scale is not None:
        module.input_scale = input_scale.to(dtype)
    return module


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
    input_scales: dict[str, torch.Tensor] = {}
    if config.method == "awq":
        if not calibration:
            raise ValueError(
                "quant.method 'awq' needs calibration token ids (see calibration_token_ids)"
            )
        input_scales = awq_input_scales(model, plan, config.scheme, calibration)
    for name, group_size in plan.items():
        linear = model.get_submodule(name)
        _set_submodule(
            model, name, quantize_linear(linear, config.scheme, group_size, input_scales.get(name))
        )
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


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


# ---- AWQ: activation-aware input-channel scales -----------------------------------------


def awq_input_scales(
    model: nn.Module, plan: dict[str, int], scheme: str, calibration: Sequence[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Per layer, the input multiplier 1 / s that minimises the layer's output error.

    s = mean|x|^alpha per input channel, alpha searched on a grid; alpha = 0 is
    plain RTN, so the search never does worse than RTN on the calibration tokens.
    """
    inputs = collect_linear_inputs(model, list(plan), calibration)
    scales = {}
    for name, group_size in plan.items():
        weight = model.get_submodule(name).weight.detach()
        scales[name] = search_input_scale(weight, inputs[name], scheme, group_size)
    return scales


@torch.no_grad()
def collect_linear_inputs(
    model: nn.Module, names: Iterable[str], calibration: Sequence[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Inputs each named Linear sees on the calibration sequences (<= AWQ_MAX_TOKENS rows)."""
    seen: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    hooks = [
        model.get_submodule(name).register_forward_pre_hook(
            lambda _mod, args, name=name: seen[name].append(args[0].reshape(-1, args[0].shape[-1]))
        )
        for name in seen
    ]
    try:
        for token_ids in calibration:
            model.compute_logits_dense(token_ids)
    finally:
        for hook in hooks:
            hook.remove()
    generator = torch.Generator().manual_seed(0)
    return {name: _subsample(torch.cat(rows), generator) for name, rows in seen.items()}


def _subsample(rows: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    if rows.shape[0] <= AWQ_MAX_TOKENS:
        return rows
    keep = torch.randperm(rows.shape[0], generator=generator)[:AWQ_MAX_TOKENS]
    return rows[keep.to(rows.device)]


@torch.no_grad()
def search_input_scale(
    weight: torch.Tensor, x: torch.Tensor, scheme: str, group_size: int
) -> torch.Tensor:
    """AWQ's grid search for one layer: weight [N, K], calibration inputs x [T, K] -> 1 / s [K]."""
    weight, x = weight.float(), x.float()
    reference = x @ weight.t()  # [T, N]
    activation = x.abs().mean(dim=0).clamp(min=1e-5)  # [K]
    best_error, best_scale = float("inf"), torch.ones_like(activation)
    for alpha in torch.arange(AWQ_GRID) / AWQ_GRID:
        scale = activation.pow(alpha)
        scale = scale / (scale.max() * scale.min()).sqrt()
        # y = (x / s) @ Q(W * s).T, i.e. x @ (Q(W * s) / s).T
        effective = fake_quantize(weight * scale, scheme, group_size) / scale
        error = (x @ effective.t() - reference).pow(2).mean().item()
        if error < best_error:
            best_error, best_scale = error, scale
    return 1 / best_scale


def calibration_token_ids(
    path: Path = DEFAULT_CALIBRATION_PATH, split: str = "calib"
) -> list[torch.Tensor]:
    """Prompt + reference token ids of the project's calibration prompts (never the eval ones)."""
    sequences = []
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        if row["split"] == split:
            sequences.append(torch.tensor(row["prompt_ids"] + row["reference_ids"]))
    if not sequences:
        raise ValueError(f"no {split!r} prompts in {path}")
    return sequences


# ---- checkpoints ----------------------------------------------------------------------


def checkpoint_filename(config: QuantConfig) -> str:
    """A file name that changes whenever the quantized tensors would."""
    head = "-lm_head" if config.quantize_lm_head else ""
    group = "" if config.scheme == "int8" else f"-g{config.group_size}"
    return f"{config.scheme}{group}-{config.method}{head}.safetensors"


def save_quantized(model: nn.Module, path: Path, config: QuantConfig) -> None:
    """Write every tensor of a quantized model, with what is needed to rebuild it, atomically."""
    tensors, aliases = _unique_tensors(model.state_dict())
    metadata = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "config": json.dumps(_config_fields(config)),
        "layers": json.dumps(_layer_specs(model)),
        "aliases": json.dumps(aliases),
        "sha256": _checksum(tensors),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    save_file(tensors, partial, metadata=metadata)
    partial.rename(path)


def load_quantized(model: nn.Module, path: Path, config: QuantConfig) -> nn.Module:
    """Load a file written by `save_quantized` into an unquantized model skeleton.

    `model` may live on the meta device: every persistent tensor comes from the
    file. Raises ValueError when the file is corrupt, was made with another
    QuantConfig, or does not fit the model.
    """
    metadata = _read_metadata(path)
    if json.loads(metadata["config"]) != _config_fields(config):
        raise ValueError(
            f"{path} was quantized with {metadata['config']}, not {_config_fields(config)}: "
            "delete it to re-quantize"
        )
    for name, spec in json.loads(metadata["layers"]).items():
        _set_submodule(model, name, _empty_quant_linear(model, name, spec, path))
    tensors = _read_tensors(path, metadata["sha256"])
    aliases: dict[str, str] = json.loads(metadata["aliases"])
    try:
        missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    except RuntimeError as error:
        raise ValueError(f"{path} does not fit this model: {error}") from error
    missing = [name for name in missing if name not in aliases]
    if missing or unexpected:
        raise ValueError(
            f"{path} does not fit this model: missing {missing}, unexpected {unexpected}"
        )
    for alias, source in aliases.items():
        _tie(model, alias, source)
    return model


def _config_fields(config: QuantConfig) -> dict[str, object]:
    return {
        "scheme": config.scheme,
        "group_size": config.group_size,
        "method": config.method,
        "quantize_lm_head": config.quantize_lm_head,
    }


def _layer_specs(model: nn.Module) -> dict[str, dict[str, object]]:
    """What `load_quantized` needs to rebuild each quantized module before loading its tensors."""
    return {
        name: {
            "kind": "int8" if isinstance(m, Int8Linear) else "int4",
            "group_size": getattr(m, "group_size", 0),
            "awq": m.input_scale is not None,
        }
        for name, m in model.named_modules()
        if isinstance(m, QuantLinear)
    }


def _empty_quant_linear(model: nn.Module, name: str, spec: dict, path: Path) -> QuantLinear:
    try:
        linear = model.get_submodule(name)
    except AttributeError:
        linear = None
    if not isinstance(linear, nn.Linear):
        raise ValueError(f"{path} quantizes {name!r}, which is not a Linear of this model")
    args = (linear.in_features, linear.out_features)
    kwargs = {
        "bias": linear.bias is not None,
        "dtype": linear.weight.dtype,
        "device": linear.weight.device,
    }
    module: QuantLinear = (
        Int8Linear(*args, **kwargs)
        if spec["kind"] == "int8"
        else Int4Linear(*args, group_size=spec["group_size"], **kwargs)
    )
    if spec["awq"]:
        module.input_scale = torch.empty(
            linear.in_features, dtype=kwargs["dtype"], device=kwargs["device"]
        )
    return module


def _unique_tensors(
    state: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Drop tensors sharing storage with an earlier one (tied weights): safetensors refuses them."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first: dict[tuple[int, tuple[int, ...]], str] = {}
    for name, tensor in state.items():
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
            tensors[name] = tensor.contiguous()
    return tensors, aliases


def _tie(model: nn.Module, alias: str, source: str) -> None:
    owner, _, attr = alias.rpartition(".")
    src_owner, _, src_attr = source.rpartition(".")
    setattr(model.get_submodule(owner), attr, getattr(model.get_submodule(src_owner), src_attr))


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _read_metadata(path: Path) -> dict[str, str]:
    try:
        with safe_open(str(path), framework="pt") as file:
            metadata = file.metadata() or {}
    except (SafetensorError, OSError) as error:
        raise ValueError(
            f"{path} is not a readable safetensors file ({error}): delete it to re-quantize"
        ) from error
    if metadata.get("format") != FORMAT or metadata.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{path} is not a {FORMAT} v{FORMAT_VERSION} checkpoint "
            f"(format={metadata.get('format')!r}, version={metadata.get('version')!r})"
        )
    return metadata


def _read_tensors(path: Path, expected_sha256: str) -> dict[str, torch.Tensor]:
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{path} is corrupt ({error}): delete it to re-quantize") from error
    if _checksum(tensors) != expected_sha256:
        raise ValueError(f"{path} is corrupt (checksum mismatch): delete it to re-quantize")
    return tensors
