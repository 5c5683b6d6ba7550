"""Quantized checkpoints: one safetensors file per (model, QuantConfig).

Everything a quantized model holds is written (quantized buffers and the
unquantized rest), so loading never reads the original weights and can fill a
skeleton built on the meta device. The header carries the QuantConfig, the
per-layer scheme, tied-weight aliases and a sha256 of the tensor bytes:
a file made with another config, for another model shape, truncated or with
flipped bytes is refused with a ValueError that says to delete it.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from engine.config import QuantConfig
from engine.quant import linear as quant

FORMAT = "tierserve-quant"
FORMAT_VERSION = "1"
METADATA_KEYS = ("config", "layers", "aliases", "sha256")


def checkpoint_filename(config: QuantConfig) -> str:
    """A file name that changes whenever the quantized tensors would."""
    head = "-lm_head" if config.quantize_lm_head else ""
    group = "" if config.scheme == "int8" else f"-g{config.group_size}"
    mixed = "".join(f"-int8_{name}" for name in sorted(config.int8_layers))
    version = f"-v{quant.ALGORITHM_VERSION}"
    return f"{config.scheme}{group}-{config.method}{head}{mixed}{version}.safetensors"


def save_quantized(model: nn.Module, path: Path, config: QuantConfig) -> None:
    """Write every tensor of a quantized model, with what is needed to rebuild it, atomically.

    The file is written under a unique temporary name beside `path` (`.<name>.<random>.partial`,
    engine.model.loader's convention) and renamed over it: concurrent readers see the old
    file or the new one, never half of one.
    """
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
    partial = path.with_name(f".{path.name}.{uuid.uuid4().hex}.partial")
    try:
        save_file(tensors, partial, metadata=metadata)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


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
        quant.set_submodule(model, name, _empty_quant_linear(model, name, spec, path))
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
        **({"int8_layers": sorted(config.int8_layers)} if config.int8_layers else {}),
    }


def _layer_specs(model: nn.Module) -> dict[str, dict[str, object]]:
    """What `load_quantized` needs to rebuild each quantized module before loading its tensors."""
    return {
        name: {
            "kind": "int8" if isinstance(m, quant.Int8Linear) else "int4",
            "group_size": getattr(m, "group_size", 0),
            "awq": m.input_scale is not None,
        }
        for name, m in model.named_modules()
        if isinstance(m, quant.QuantLinear)
    }


def _empty_quant_linear(model: nn.Module, name: str, spec: dict, path: Path) -> quant.QuantLinear:
    try:
        linear = model.get_submodule(name)
    except AttributeError:
        linear = None
    if not isinstance(linear, nn.Linear):
        raise ValueError(f"{path} quantizes {name!r}, which is not a Linear of this model")
    k, n, bias = linear.in_features, linear.out_features, linear.bias is not None
    dtype, device = linear.weight.dtype, linear.weight.device
    module: quant.QuantLinear
    if spec["kind"] == "int8":
        module = quant.Int8Linear(k, n, bias, dtype, device)
    else:
        module = quant.Int4Linear(k, n, spec["group_size"], bias, dtype, device)
    if spec["awq"]:
        module.input_scale = torch.empty(k, dtype=dtype, device=device)
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
    missing = [key for key in METADATA_KEYS if key not in metadata]
    if missing:
        raise ValueError(f"{path} lacks metadata {missing}: delete it to re-quantize")
    return metadata


def _read_tensors(path: Path, expected_sha256: str) -> dict[str, torch.Tensor]:
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{path} is corrupt ({error}): delete it to re-quantize") from error
    if _checksum(tensors) != expected_sha256:
        raise ValueError(f"{path} is corrupt (checksum mismatch): delete it to re-quantize")
    # Own, 64-byte aligned copies: the file's views are only 8-byte aligned,
    # which the packed CPU kernels cannot take.
    return {name: tensor.clone() for name, tensor in tensors.items()}
