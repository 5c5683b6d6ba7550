"""engine.parallel.shard: each rank's slice of a model, and the sum that puts them back
together. The ranks here are threads of this process meeting at a barrier to add their
partial products, so the arithmetic is checked without processes (the gloo ranks
themselves: tests/integration/test_tensor_parallel.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.config import EngineConfig, QuantConfig
from engine.model.loader import load_model
from engine.parallel.shard import check_shardable, shard_args, shard_model, split_range
from testing.architectures import save_tiny_model


@pytest.mark.parametrize(("count", "world_size"), [(3, 2), (9, 2), (1536, 2), (7, 3), (4, 4)])
def test_ranks_share_every_item_once_the_first_ones_taking_the_remainder(count, world_size):
    shares = [split_range(count, world_size, rank) for rank in range(world_size)]
    assert [i for share in shares for i in share] == list(range(count))
    assert [len(s) for s in shares] == sorted((len(s) for s in shares), reverse=True)
    assert len(shares[0]) - len(shares[-1]) <= 1


class ThreadSum:
    """An all-reduce for ranks that are threads: each adds its tensor, waits for the others,
    then every rank reads the total."""

    def __init__(self, world_size: int) -> None:
        self._barrier = threading.Barrier(world_size)
        self._total: torch.Tensor | None = None
        self._lock = threading.Lock()

    def __call__(self, tensor: torch.Tensor) -> None:
        with self._lock:
            self._total = tensor.clone() if self._total is None else self._total + tensor
        self._barrier.wait()
        tensor.copy_(self._total)
        if self._barrier.wait() == 0:
            self._total = None
        self._barrier.wait()


def sharded_logits(model, world_size: int, prompt: torch.Tensor) -> list[torch.Tensor]:
    """Each rank's logits for `prompt`, the ranks running together in threads."""
    total = ThreadSum(world_size)
    shards = [shard_model(model, world_size, rank, total) for rank in range(world_size)]
    logits: list[torch.Tensor | None] = [None] * world_size

    def run(rank: int) -> None:
        with torch.inference_mode():
            logits[rank] = shards[rank].compute_logits_dense(prompt)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return logits


@pytest.mark.parametrize("architecture", ["llama3", "qwen2", "qwen3", "gemma3", "phi3"])
def test_the_ranks_together_compute_the_whole_model(architecture, tmp_path):
    """Biases (Qwen2), q/k norms (Qwen3, Gemma), sandwich norms and tied embeddings (Gemma),
    fused projections (Phi-3): the sum of the slices is the model, on every rank."""
    folder = save_tiny_model(architecture, tmp_path)
    model, _ = load_model(EngineConfig(model=str(folder), dtype="float32"))
    prompt = torch.arange(3, 40)
    with torch.inference_mode():
        whole = model.compute_logits_dense(prompt)
    for world_size in (2, model.args.num_kv_heads):
        for logits in sharded_logits(model, world_size, prompt):
            torch.testing.assert_close(logits, whole, atol=1e-4, rtol=1e-4)


def test_the_default_model_splits_unevenly_by_kv_head_groups():
    """SmolLM2: 9 query heads over 3 KV heads, 2 ranks: rank 0 keeps two groups."""
    model, _ = load_model(EngineConfig(dtype="float32"))
    args = model.args
    ranks = [shard_args(args, 2, rank) for rank in (0, 1)]
    assert [(a.num_kv_heads, a.num_heads) for a in ranks] == [(2, 6), (1, 3)]
    assert sum(a.intermediate_size for a in ranks) == args.intermediate_size
    prompt = torch.arange(100, 130)
    with torch.inference_mode():
        whole = model.compute_logits_dense(prompt)
    for logits in sharded_logits(model, 2, prompt):
        torch.testing.assert_close(logits, whole, atol=1e-4, rtol=1e-4)


def test_a_model_that_cannot_be_split_is_refused_naming_the_setting(tmp_path):
    model, _ = load_model(EngineConfig(model=str(save_tiny_model("mixtral", tmp_path)),
                                       dtype="float32"))  # fmt: skip
    with pytest.raises(ValueError, match="tensor_parallel_size.*mixture-of-experts"):
        check_shardable(model, 2)
    dense, _ = load_model(EngineConfig(dtype="float32"))
    with pytest.raises(ValueError, match="tensor_parallel_size 4 exceeds the model's 3 KV heads"):
        shard_args(dense.args, 4, 0)


def test_quantized_layers_are_refused_not_sliced():
    model, _ = load_model(EngineConfig(dtype="float32"))
    layer = model.layers[0]
    layer.mlp.down_proj = torch.nn.Identity()  # any projection that is not a dense nn.Linear
    with pytest.raises(ValueError, match="dense weights only"):
        check_shardable(model, 2)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1"),
        ({"tensor_parallel_size": 2, "device": "cuda"}, "CPU cores"),
        ({"tensor_parallel_size": 2, "quant": QuantConfig(scheme="int4")}, "dense weights only"),
    ],
)
def test_engine_config_refuses_what_tensor_parallelism_cannot_do(overrides, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**overrides)
