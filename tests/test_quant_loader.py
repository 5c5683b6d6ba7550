"""The loader's quantized path: quantize once, save, and reload the same model from the cache."""

from __future__ import annotations

import dataclasses
import json

import torch

from engine.config import EngineConfig, QuantConfig, default_cache_dir
from engine.model.llama import ModelArgs
from engine.model.loader import resolve_model_dir
from engine.quant.linear import QuantLinear
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
    ]
    paths = {quantized_checkpoint_path(model_dir, args, c) for c in variants}
    truncated = dataclasses.replace(args, num_layers=4)
    paths.add(quantized_checkpoint_path(model_dir, truncated, base))
    assert len(paths) == 4
