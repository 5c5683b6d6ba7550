"""The model cache: GGUF conversions and quantized checkpoints are built once, by one process,
keyed by the weights' content, and a damaged checkpoint is rebuilt rather than fatal."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlamaForCausalLM

from bench.paths import REPO_ROOT
from engine.config import EngineConfig, QuantConfig, default_cache_dir
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import (
    cache_lock,
    content_digest,
    converted_gguf_dir,
    converted_gguf_path,
    default_gguf_path,
    load_dense,
    model_args,
    resolve_model_dir,
)
from engine.quant.checkpoint import load_quantized, save_quantized
from engine.quant.prepare import load_quantized_model, quantize_model, quantized_checkpoint_path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
PROMPT_IDS = torch.tensor([1, 5, 42, 7, 300, 9, 2])
WAITING = "waiting for another process"
CHILD_TIMEOUT_S = 240

CHILD = """
import hashlib, json, sys
import torch
torch.set_num_threads(1)
from engine.config import EngineConfig, QuantConfig
from engine.model.loader import resolve_model_dir
from engine.quant.prepare import prepare_model
from pathlib import Path
mode, cache_dir, model = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
if mode == "convert":
    print(json.dumps({"dir": str(resolve_model_dir(model, cache_dir))}))
else:
    config = EngineConfig(model=model, cache_dir=cache_dir, dtype="float32", quant=QuantConfig())
    llm, _ = prepare_model(config)
    with torch.inference_mode():
        logits = llm.compute_logits_dense(torch.tensor([1, 5, 42, 7, 300, 9, 2]))
    print(json.dumps({"logits": hashlib.sha256(logits.numpy().tobytes()).hexdigest()}))
"""
"""A pool's first start in miniature: its own process, then the cache, then the model."""


def start_together(
    tmp_path: Path, cache_dir: Path, entry: Path, mode: str, model: str
) -> list[dict]:
    """Run two CHILDs with `entry` locked until both wait on it; their results.

    Holding the real lock until both say they wait makes them contend for it, whatever
    the timing: one must build the entry, the other load what it wrote.
    """
    logs = [tmp_path / f"child{i}.err" for i in range(2)]
    with cache_lock(entry):
        children = [spawn_child([mode, str(cache_dir), model], log) for log in logs]
        deadline_s = time.monotonic() + CHILD_TIMEOUT_S
        while not all(WAITING in log.read_text() for log in logs):
            assert time.monotonic() < deadline_s, "the children never queued on the lock"
            assert all(child.poll() is None for child in children), "a child exited early"
            time.sleep(0.1)
    results = []
    for child, log in zip(children, logs, strict=True):
        out, _ = child.communicate(timeout=CHILD_TIMEOUT_S)
        assert child.returncode == 0, log.read_text()[-3000:]
        results.append({**json.loads(out.splitlines()[-1]), "stderr": log.read_text()})
    return results


def spawn_child(args: list[str], stderr: Path) -> subprocess.Popen[str]:
    """CHILD in its own interpreter, stdout piped back, stderr to a file."""
    with stderr.open("w") as err:
        return subprocess.Popen(
            [sys.executable, "-c", CHILD, *args],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )


def entries(folder: Path) -> list[Path]:
    """What a cache folder holds besides lock files."""
    return sorted(p for p in folder.iterdir() if p.suffix != ".lock")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random two-layer Llama HF folder with the default model's tokenizer."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    HFLlamaForCausalLM(config).save_pretrained(folder)
    default_dir = resolve_model_dir("default", default_cache_dir())
    for name in TOKENIZER_FILES:
        shutil.copy(default_dir / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def converted_cache(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """An empty cache on which two processes resolved the default model at once."""
    tmp_path = tmp_path_factory.mktemp("convert")
    cache_dir = tmp_path / "cache"
    entry = converted_gguf_path(default_gguf_path(), cache_dir)
    return cache_dir, start_together(tmp_path, cache_dir, entry, "convert", "default")


def quant_config(model_dir: Path, cache_dir: Path) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir), cache_dir=cache_dir, dtype="float32", quant=QuantConfig("int8")
    )


def logits_of(config: EngineConfig) -> torch.Tensor:
    model, _ = load_quantized_model(config)
    with torch.inference_mode():
        return model.compute_logits_dense(PROMPT_IDS)


def test_two_processes_converting_at_once_both_start_on_one_folder(converted_cache) -> None:
    cache_dir, results = converted_cache
    (folder,) = entries(cache_dir / "converted")
    assert [r["dir"] for r in results] == [str(folder), str(folder)]
    assert sum("tierserve: converting" in r["stderr"] for r in results) == 1
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def test_two_processes_quantizing_at_once_both_load_one_checkpoint(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = quant_config(tiny_model_dir, tmp_path / "cache")
    path = quantized_checkpoint_path(tiny_model_dir, model_args(tiny_model_dir), config)
    results = start_together(tmp_path, config.cache_dir, path, "quantize", str(tiny_model_dir))
    assert sum("tierserve: quantizing" in r["stderr"] for r in results) == 1
    assert results[0]["logits"] == results[1]["logits"]
    assert entries(path.parent) == [path]
    assert entries(path.parents[1]) == [path.parent]


@pytest.mark.parametrize("damage", ["flip", "truncate", "other-config"])
def test_a_damaged_checkpoint_is_rebuilt_with_identical_outputs(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    config = quant_config(tiny_model_dir, tmp_path)
    expected = logits_of(config)
    args = model_args(tiny_model_dir)
    path = quantized_checkpoint_path(tiny_model_dir, args, config)
    good = path.read_bytes()
    if damage == "flip":
        path.write_bytes(good[:-100] + bytes([good[-100] ^ 0xFF]) + good[-99:])
    elif damage == "truncate":
        path.write_bytes(good[: len(good) // 2])
    else:  # a stale file: valid, but made with another QuantConfig
        other = QuantConfig("int4", 64)
        dense = load_dense(tiny_model_dir, args, config)
        save_quantized(quantize_model(dense, other), path, other)
    with caplog.at_level(logging.WARNING, logger="engine.quant.prepare"):
        actual = logits_of(config)
    assert "quantizing again" in caplog.text
    assert torch.equal(actual, expected)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(args)
    load_quantized(skeleton, path, config.quant)  # the rebuilt file is whole again


def test_checkpoint_key_follows_the_weights_not_the_folder(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = quant_config(tiny_model_dir, tmp_path / "cache")
    args = model_args(tiny_model_dir)
    original = quantized_checkpoint_path(tiny_model_dir, args, config)
    copied = shutil.copytree(tiny_model_dir, tmp_path / "copy")
    moved = copied.rename(tmp_path / "moved")
    assert quantized_checkpoint_path(moved, args, config) == original
    weights = moved / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.norm.weight"][0] += 1.0
    save_file(tensors, weights, metadata={"format": "pt"})
    assert quantized_checkpoint_path(moved, args, config) != original


def test_conversion_key_follows_the_gguf_not_its_path(converted_cache, tmp_path: Path) -> None:
    cache_dir, results = converted_cache
    copy = Path(shutil.copy(default_gguf_path(), tmp_path))
    assert str(converted_gguf_dir(copy, cache_dir)) == results[0]["dir"]
    with copy.open("ab") as file:
        file.write(b"\0")
    assert content_digest([copy], cache_dir) != content_digest([default_gguf_path()], cache_dir)
