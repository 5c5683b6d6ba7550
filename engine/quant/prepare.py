"""The model a pool serves: dense, or quantized once per `QuantConfig` and cached.

Quantizing (AWQ calibrates for a minute or so) happens the first time a
config is used; the result is saved as a checksummed checkpoint
(engine/quant/checkpoint.py) and later starts load that file onto the meta
device's empty modules instead of quantizing again.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.config import EngineConfig, QuantConfig
from engine.model.fp8_weights import Fp8Weights
from engine.model.llama import LlamaForCausalLM, ModelArgs
from engine.model.loader import (
    KEY_CHARS,
    cache_lock,
    content_digest,
    load_dense,
    load_model,
    model_args,
    resolve_model_dir,
)
from engine.quant.awq import calibration_token_ids, search_model
from engine.quant.checkpoint import checkpoint_filename, load_quantized, save_quantized
from engine.quant.fp8_linear import computes_fp8, load_fp8
from engine.quant.linear import (
    quantization_plan,
    quantize_linear,
    set_submodule,
    switch_to_int8_activations,
)
from engine.quant.maths import AwqParams, scheme_of
from engine.quant.prequantized import HubInt4, load_prequantized

log = logging.getLogger(__name__)


def prepare_model(
    config: EngineConfig, num_layers: int | None = None
) -> tuple[LlamaForCausalLM, PreTrainedTokenizerBase]:
    """The model and tokenizer for `config`: INT4 as its checkpoint was quantized (AWQ,
    GPTQ), FP8 as stored, quantized per `config.quant`, else dense."""
    model_dir = resolve_model_dir(config.model, config.cache_dir)
    hf_config = json.loads((model_dir / "config.json").read_text())
    hub_int4, fp8 = HubInt4.from_hf_config(hf_config), Fp8Weights.from_hf_config(hf_config)
    if fp8 is not None and config.quant is None and computes_fp8(config):
        model = load_fp8(model_dir, model_args(model_dir, num_layers), config, fp8)
        return model, AutoTokenizer.from_pretrained(model_dir)
    if hub_int4 is not None:
        if config.quant is not None:
            raise ValueError(
                f"{model_dir} is already quantized ({hub_int4.method}): leave engine.quant unset"
            )
        args = model_args(model_dir, num_layers)
        model = load_prequantized(model_dir, args, config, hub_int4)
        return model, AutoTokenizer.from_pretrained(model_dir)
    if config.quant is None:
        return load_model(config, num_layers)
    return load_quantized_model(config, num_layers)


def load_quantized_model(
    config: EngineConfig, num_layers: int | None = None
) -> tuple[LlamaForCausalLM, PreTrainedTokenizerBase]:
    """Quantize once per checkpoint path, then reuse the saved checkpoint.

    A missing, corrupt or stale checkpoint is (re)built under the entry's cache lock:
    of several pools starting together one quantizes, the others wait and load its
    file. A refused file is logged and rebuilt, never fatal.
    """
    quant = config.quant
    assert quant is not None, "load_quantized_model needs config.quant"
    model_dir = resolve_model_dir(config.model, config.cache_dir)
    args = model_args(model_dir, num_layers)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    path = quantized_checkpoint_path(model_dir, args, config)
    model = _load_checkpoint(path, args, quant)
    if model is None:
        with cache_lock(path):
            model = _load_checkpoint(path, args, quant)  # written while we waited?
            if model is None:
                model = _quantize(model_dir, args, config, tokenizer)
                save_quantized(model, path, quant)
    model = model.to(config.device).eval()
    if quant.activations == "int8" and torch.device(config.device).type == "cpu":
        switched = switch_to_int8_activations(model)
        log.info("quant: %d layers compute with int8 activations", switched)
    return model, tokenizer


def _quantize(
    model_dir: Path, args: ModelArgs, config: EngineConfig, tokenizer: PreTrainedTokenizerBase
) -> LlamaForCausalLM:
    """The dense model quantized per `config.quant` (AWQ calibrates on our own prompts)."""
    assert config.quant is not None
    quant = config.quant
    print(f"tierserve: quantizing to {quant.scheme} ({quant.method}), once...", file=sys.stderr)
    model = load_dense(model_dir, args, config)
    calibration = calibration_token_ids(tokenizer) if quant.method == "awq" else ()
    quantize_model(model, quant, calibration)
    return model


def _load_checkpoint(path: Path, args: ModelArgs, quant: QuantConfig) -> LlamaForCausalLM | None:
    """The model from its checkpoint; None when there is none or it is refused (logged)."""
    if not path.is_file():
        return None
    with torch.device("meta"):
        model = LlamaForCausalLM(args)
    try:
        load_quantized(model, path, quant)
    except ValueError as error:
        log.warning("tierserve: quantizing again, the checkpoint is refused: %s", error)
        return None
    model.reset_rope()
    return model


def quantized_checkpoint_path(model_dir: Path, args: ModelArgs, config: EngineConfig) -> Path:
    """Cache path keyed by the weights' content, dtype, depth and quantization settings.

    The key is a digest of the folder's safetensors and config.json (engine.model.loader's
    `content_digest`): a moved or copied folder finds its checkpoint, changed weights
    get a new one.
    """
    assert config.quant is not None
    sources = [*model_dir.glob("*.safetensors"), model_dir / "config.json"]
    key = content_digest(sources, config.cache_dir)[:KEY_CHARS]
    variant = f"{key}-{config.dtype}-{args.num_layers}L"
    return Path(config.cache_dir) / "quantized" / variant / checkpoint_filename(config.quant)


def quantize_model(
    model: nn.Module, config: QuantConfig, calibration: Sequence[torch.Tensor] = ()
) -> nn.Module:
    """Replace every eligible nn.Linear of `model` in place and return it.

    `calibration` (token-id sequences) is needed by method "awq": the model must
    expose `compute_logits_dense(token_ids)`. Layers whose shape the scheme
    cannot take (INT4 needs N % 64 == 0 and a group of >= 32 dividing K) stay
    as they are, with a warning; `config.int8_layers` take INT8.
    """
    plan = quantization_plan(model, config)
    found: dict[str, AwqParams] = {}
    if config.method == "awq":
        if not calibration:
            raise ValueError(
                "quant.method 'awq' needs calibration token ids "
                "(engine.quant.awq.calibration_token_ids)"
            )
        found = search_model(model, plan, calibration)
    for name, group_size in plan.items():
        linear = model.get_submodule(name)
        assert isinstance(linear, nn.Linear)
        qlinear = quantize_linear(linear, scheme_of(group_size), group_size, found.get(name))
        set_submodule(model, name, qlinear)
    return model
