"""One rank's slice of a model, Megatron-style: two sums over the ranks a layer.

Q/K/V and gate/up are column-parallel: each rank computes its own heads and its
own hidden units from the whole input, so nothing is exchanged before the
output projections. O and down are row-parallel: each rank multiplies its slice
of their input by its slice of their columns, and the partial products are
summed over the ranks (`RowParallel`), leaving every rank with the same full
hidden state. Embedding, norms and the head are replicated: at this model size
the head's 49k rows cost one matmul on rank 0 only, where the sampler runs.

Attention is split by KV-head groups (each rank keeps a KV head with the query
heads that read it), so the KV cache is split the same way and a rank never
needs another's keys. Counts that do not divide evenly (SmolLM2's 3 KV heads
over 2 ranks) give the first ranks one group more.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from engine.model.args import ModelArgs
from engine.model.llama import LlamaForCausalLM

AllReduce = Callable[[torch.Tensor], None]
"""Sums a tensor over the ranks, in place (engine.parallel.ranks supplies it)."""


def split_range(count: int, world_size: int, rank: int) -> range:
    """Rank `rank`'s contiguous share of `count` items, the first ranks one more when
    `count` does not divide evenly."""
    base, extra = divmod(count, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def check_shardable(model: LlamaForCausalLM, world_size: int) -> None:
    """ValueError naming `tensor_parallel_size` where this model cannot be split that way."""
    _check_args(model.args, world_size)
    for layer in model.layers:
        projections = (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                       layer.mlp.gate_up_proj, layer.mlp.down_proj)  # fmt: skip
        if any(type(p) is not nn.Linear for p in projections):
            raise ValueError(
                "tensor_parallel_size > 1 splits dense weights only so far: this checkpoint "
                "is quantized (serve it with tensor_parallel_size 1)"
            )


def _check_args(args: ModelArgs, world_size: int) -> None:
    if args.moe is not None:
        raise ValueError(
            "tensor_parallel_size > 1 does not split a mixture-of-experts model yet: "
            "serve it with tensor_parallel_size 1"
        )
    if args.num_kv_heads < world_size:
        raise ValueError(
            f"tensor_parallel_size {world_size} exceeds the model's {args.num_kv_heads} KV "
            "heads: each rank holds at least one KV head and the query heads that read it"
        )


def shard_args(args: ModelArgs, world_size: int, rank: int) -> ModelArgs:
    """The architecture of rank `rank`'s slice: its KV heads, their query heads, its
    share of the feed-forward's hidden units; head_dim is unchanged."""
    _check_args(args, world_size)
    group = args.num_heads // args.num_kv_heads
    kv_heads = len(split_range(args.num_kv_heads, world_size, rank))
    units = len(split_range(args.intermediate_size, world_size, rank))
    return dataclasses.replace(
        args, num_heads=kv_heads * group, num_kv_heads=kv_heads, intermediate_size=units
    )


def shard_state(
    state: dict[str, torch.Tensor], args: ModelArgs, world_size: int, rank: int
) -> dict[str, torch.Tensor]:
    """Rank `rank`'s tensors of an engine state dict (engine names: fused qkv_proj and
    gate_up_proj); a row-parallel bias only on rank 0, so the sum adds it once."""
    slicer = _Slicer(args, world_size, rank)
    return {name: slicer.slice(name, tensor).contiguous() for name, tensor in state.items()}


@dataclasses.dataclass(frozen=True)
class _Slicer:
    args: ModelArgs
    world_size: int
    rank: int

    def slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the tensor `name` (itself, for a replicated one)."""
        module, _, kind = name.rpartition(".")
        if module.endswith("qkv_proj"):
            return self._qkv_rows(tensor)
        if module.endswith("gate_up_proj"):
            half = self.args.intermediate_size
            units = self._units()
            return torch.cat([tensor[units], tensor[half + units.start : half + units.stop]])
        if module.endswith(("o_proj", "down_proj")):
            if kind == "bias":
                return tensor if self.rank == 0 else torch.zeros_like(tensor)
            columns = self._q_columns() if module.endswith("o_proj") else self._units()
            return tensor[:, columns]
        return tensor

    def _units(self) -> slice:
        share = split_range(self.args.intermediate_size, self.world_size, self.rank)
        return slice(share.start, share.stop)

    def _kv_heads(self) -> range:
        return split_range(self.args.num_kv_heads, self.world_size, self.rank)

    def _q_columns(self) -> slice:
        """This rank's query heads as columns of q (and of o_proj's input)."""
        heads = self._kv_heads()
        width = self.args.num_heads // self.args.num_kv_heads * self.args.head_dim
        return slice(heads.start * width, heads.stop * width)

    def _qkv_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """qkv_proj's rows (weight or bias) of this rank's query, key and value heads."""
        q_size = self.args.num_heads * self.args.head_dim
        kv_size = self.args.num_kv_heads * self.args.head_dim
        heads, dim = self._kv_heads(), self.args.head_dim
        kv = slice(heads.start * dim, heads.stop * dim)
        q, k, v = tensor.split([q_size, kv_size, kv_size])
        return torch.cat([q[self._q_columns()], k[kv], v[kv]])


class RowParallel(nn.Module):
    """A row-parallel projection: this rank's partial product, summed over the ranks."""

    def __init__(self, linear: nn.Module, all_reduce: AllReduce) -> None:
        super().__init__()
        self.linear = linear
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The full projection of the full input, every rank holding the same result."""
        out = self.linear(x)
        self.all_reduce(out)
        return out


def shard_model(
    model: LlamaForCausalLM, world_size: int, rank: int, all_reduce: AllReduce
) -> LlamaForCausalLM:
    """Rank `rank`'s slice of a loaded dense model (the model is left as it was; drop it to
    free its memory). Quantized layers are not split yet: the caller refuses them."""
    check_shardable(model, world_size)
    args = model.args
    local_args = shard_args(args, world_size, rank)
    state = shard_state(model.state_dict(), args, world_size, rank)
    with torch.device("meta"):
        local = LlamaForCausalLM(local_args)
    local.load_engine_state(state)
    for layer in local.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, all_reduce)
        layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, all_reduce)
    return local.eval()
