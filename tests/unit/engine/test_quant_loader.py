"""The loader's quantized path: quantize once, save, and reload the same model from the cache."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from engine.config import EngineConfig, QuantConfig, default_cache_dir
from engine.kernels import w4a8
from engine.model.llama import ModelArgs
from engine.model.loader import resolve_model_dir
from engine.quant.linear import Int4Linear, Int8Linear, QuantLinear
from engine.quant.prepare import load_quantized_model, quantized_checkpoint_path


def test_quantized_model_is_cached_and_reloads_identically(tmp_path) -> None:
    model_dir = resolve_model_dir("default", default_cache_dir())
    config = EngineConfig(model=str(model_dir), cache_dir=tmp_path, quant=QuantConfig("int8"))
    first, tokenizer = load_quantized_model(config)
    args = first.args
    assert quantized_checkpoint_path(model_dir, args, config).is_file()
    second, _ = load_quantized_model(config)  # from the checkpoint this time, not re-quantized
    assert isinstance(second.layers[0].self_attn.qkv_proj, QuantLinear)
    ids = torch.tensor(tokenizer.encode("The capital of France is"))
    with torch.inference_mode():
        expected, actual = first.compute_logits_dense(ids), second.compute_logits_dense(ids)
    torch.testing.assert_close(actual, expected)


def test_checkpoint_path_separates_dtype_depth_and_scheme(tmp_path) -> None:
    model_dir = resolve_model_dir("default", default_cache_dir())
    args = ModelArgs.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    base = EngineConfig(cache_dir=tmp_path, quant=QuantConfig("int8"))
    variants = [
        base,
        EngineConfig(cache_dir=tmp_path, quant=QuantConfig("int4", 64, "awq")),
        EngineConfig(cache_dir=tmp_path, dtype="float32", quant=QuantConfig("int8")),
        EngineConfig(cache_dir=tmp_path, quant=QuantConfig("int4", 64, int8_layers=["o_proj"])),
    ]
    paths = {quantized_checkpoint_path(model_dir, args, c) for c in variants}
    truncated = dataclasses.replace(args, num_layers=4)
    paths.add(quantized_checkpoint_path(model_dir, truncated, base))
    assert len(paths) == 5


def test_int8_activations_load_the_weight_only_checkpoint_and_switch_its_layers(tmp_path) -> None:
    """A mixed INT4 / INT8 model: INT4 layers switch to W4A8, INT8 ones to W8A8."""
    if not w4a8.available():
        pytest.skip("no W4A8 kernel on this CPU")
    model_dir = resolve_model_dir("default", default_cache_dir())
    mixed = QuantConfig("int4", 64, "rtn", int8_layers=("down_proj",))
    weight_only = EngineConfig(model=str(model_dir), cache_dir=tmp_path, dtype="float32",
                               quant=mixed)  # fmt: skip
    w4a8_config = dataclasses.replace(
        weight_only, quant=dataclasses.replace(mixed, activations="int8")
    )
    float_model, tokenizer = load_quantized_model(weight_only, num_layers=4)
    int8_model, _ = load_quantized_model(w4a8_config, num_layers=4)

    args = float_model.args
    path = quantized_checkpoint_path(model_dir, args, weight_only)
    assert path == quantized_checkpoint_path(model_dir, args, w4a8_config)  # one checkpoint
    int4_layers = [m for m in int8_model.modules() if isinstance(m, Int4Linear)]
    int8_layers = [m for m in int8_model.modules() if isinstance(m, Int8Linear)]
    assert int4_layers and all(m.a8_weight is not None for m in int4_layers)
    assert len(int8_layers) == 4 and all(m.a8_weight is not None for m in int8_layers)
    ids = torch.tensor(tokenizer.encode("The capital of France is"))
    with torch.inference_mode():
        expected, actual = (
            float_model.compute_logits_dense(ids),
            int8_model.compute_logits_dense(ids),
        )
    assert not torch.equal(actual, expected)
    assert torch.nn.functional.cosine_similarity(actual, expected, dim=-1).min() > 0.99
