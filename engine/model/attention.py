"""Paged attention over a packed batch.

Each step's tokens are packed into one [T] row, sequence after sequence; every
sequence brings `q_len` new tokens and attends to `kv_len` positions (its
cached context plus the new tokens). The KV cache is one flat array of slots
per layer; a slot is `block_id * block_size + offset`.

Sequences are attended in groups so padding stays cheap: all short queries
(decodes, speculative verification) share one group, and each prefill chunk
gets its own. On a CPU with a C compiler the short queries go to a kernel that
reads the paged cache in place (engine/kernels/paged_attention.c), on CUDA to its
Triton twin (engine/kernels/paged_attention_triton.py); otherwise, and for prefill
chunks, a group is one padded SDPA call. A padded group
gathers its sequences' context block by block (one `index_select` of
contiguous rows is several times faster than gathering slot by slot); a chunk
with no cached context skips the cache and attends to its own K/V with a
plain causal mask.

Sliding-window layers (Mistral, Gemma's local layers) see only the last `window`
positions of each query's context. Their groups are derived once per step and
window, on first use, from the same layout: padded SDPA groups whose mask also
hides what lies behind the window (the in-place kernel has no lower bound, so
their short queries are padded too, and a batch-invariant engine's promise does
not cover these layers). The cache keeps every position: a prefix hit reads the
same blocks, and the window is a mask over them.

A quantized cache (engine.quant.kv) is written as codes and scales; the kernel
dequantizes each row in registers as it reads it, the padded path once it has
gathered the blocks. An int8 cache holds K and V rotated, so `paged_attention` rotates
the queries and the output too; the groups never see the difference. A fresh chunk
attends to its own K/V before quantization (as vLLM does); under batch invariance
every query reads the cache instead.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from engine.kernels import paged_attention as kernels
from engine.kernels import paged_attention_triton as triton_kernel
from engine.quant import kv as kv_quant

SHORT_QUERY_MAX = 8
"""Queries up to this many tokens (decodes, verification of k drafts) share one group."""


@dataclass(frozen=True)
class AttentionGroup:
    """Sequences attended together in one padded SDPA call."""

    token_index: torch.Tensor  # [G_T] packed-token rows this group computes
    query_index: torch.Tensor  # [B, max_q] packed-token row of each padded query
    unpad_index: torch.Tensor  # [G_T] row of the flattened [B * max_q] output per token
    block_index: torch.Tensor | None  # [B * max_blocks] context block ids; None: no cache read
    mask: torch.Tensor | None  # [B, 1, max_q, max_blocks * block_size] 0 where visible, else -inf

    def attend(self, q, k, v, k_cache, v_cache) -> torch.Tensor:
        """[G_T, H, D] outputs of this group's queries."""
        q_b = q[self.query_index].transpose(1, 2)  # [B, H, max_q, D]
        if self.block_index is None:  # a fresh chunk: its own K/V are the whole context
            k_b = k[self.query_index].transpose(1, 2)  # [1, KVH, q_len, D]
            v_b = v[self.query_index].transpose(1, 2)
            out = F.scaled_dot_product_attention(q_b, k_b, v_b, is_causal=True, enable_gqa=True)
        else:
            k_b = self._gather_blocks(k_cache, q.dtype)  # [B, KVH, max_blocks * block_size, D]
            v_b = self._gather_blocks(v_cache, q.dtype)
            out = F.scaled_dot_product_attention(
                q_b, k_b, v_b, attn_mask=self.mask, enable_gqa=True
            )
        num_heads, head_dim = q.shape[1], q.shape[2]
        return out.transpose(1, 2).reshape(-1, num_heads, head_dim)[self.unpad_index]

    def _gather_blocks(self, cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The groups' context in `dtype`, dequantized from a quantized cache once gathered."""
        assert self.mask is not None and self.block_index is not None
        num_seqs, kv_len = self.mask.shape[0], self.mask.shape[-1]
        num_heads, width = cache.shape[1], cache.shape[2]
        num_blocks = self.block_index.shape[0] // num_seqs
        rows = cache.view(-1, (kv_len // num_blocks) * num_heads * width)  # a row per block
        gathered = rows.index_select(0, self.block_index)
        values = kv_quant.dequantize(gathered.view(num_seqs, kv_len, num_heads, width), dtype)
        return values.transpose(1, 2)


@dataclass(frozen=True)
class KernelGroup:
    """Short queries for an in-place kernel (C on a CPU, Triton on CUDA): no padding, no
    gathered copy."""

    token_index: torch.Tensor | None  # [G_T] packed-token rows it computes; None: all, in order
    block_tables: torch.Tensor  # [B, max_blocks] 0-padded
    query_seq: torch.Tensor  # [G_T] row of block_tables each query reads
    visible: torch.Tensor  # [G_T] context positions each query sees
    block_size: int
    thread_bounds: torch.Tensor | None
    """The queries' split over CPU threads, worked out once per step for every layer (None
    on a GPU)."""

    def attend(self, q, k, v, k_cache, v_cache) -> torch.Tensor:
        """[G_T, H, D] outputs of this group's queries, read from the paged cache in place."""
        queries = q if self.token_index is None else q[self.token_index]
        if queries.is_cuda:
            return triton_kernel.paged_attention_triton(
                queries, k_cache, v_cache, self.block_tables, self.query_seq, self.visible,
                self.block_size,
            )  # fmt: skip
        return kernels.paged_attention(
            queries, k_cache, v_cache, self.block_tables, self.query_seq, self.visible,
            self.block_size, self.thread_bounds,
        )  # fmt: skip


Group = AttentionGroup | KernelGroup


@dataclass(frozen=True)
class StepLayout:
    """What a step's groups are built from: kept to derive sliding-window groups."""

    seqs: list[_Seq]
    block_size: int
    device: torch.device | str
    dtype: torch.dtype

    def groups(self, in_place: bool, all_in_kernel: bool) -> list[Group]:
        """Short queries in one group (the in-place kernel's where `in_place`), each longer
        one in its own; `all_in_kernel`: every query is short."""
        short_max = math.inf if in_place and all_in_kernel else SHORT_QUERY_MAX
        short, long = self._split(short_max)
        groups: list[Group] = []
        if short:
            groups.append(
                _kernel_group(short, self.block_size, not long, self.device)
                if in_place
                else _group(short, self.block_size, self.dtype)
            )
        groups += [_group([s], self.block_size, self.dtype) for s in long]
        return [g if isinstance(g, KernelGroup) else _to(g, self.device) for g in groups]

    def windowed_groups(self, window: int) -> list[Group]:
        """Padded groups in which each query sees only the last `window` positions."""
        short, long = self._split(SHORT_QUERY_MAX)
        batches = ([short] if short else []) + [[s] for s in long]
        return [_to(_group(b, self.block_size, self.dtype, window), self.device) for b in batches]

    def _split(self, short_max: float) -> tuple[list[_Seq], list[_Seq]]:
        short = [s for s in self.seqs if s.q_len <= short_max]
        return short, [s for s in self.seqs if s.q_len > short_max]


@dataclass(frozen=True)
class AttentionMetadata:
    """Where a step's packed tokens sit and how they attend: built once, read by every layer."""

    positions: torch.Tensor  # [T] absolute position of each packed token
    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V is written to
    groups: list[Group]
    layout: StepLayout
    _windowed: dict[int, list[Group]] = field(default_factory=dict, compare=False, repr=False)

    def groups_within(self, window: int | None) -> list[Group]:
        """The groups of a layer that sees `window` positions back (None: all of them)."""
        if window is None:
            return self.groups
        if window not in self._windowed:
            self._windowed[window] = self.layout.windowed_groups(window)
        return self._windowed[window]

    @classmethod
    def build(
        cls,
        q_lens: list[int],
        kv_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        native_kernel: bool = True,
        all_in_kernel: bool = False,
    ) -> AttentionMetadata:
        """Describe one step: sequence b computes its last `q_lens[b]` of `kv_lens[b]` tokens.
        `native_kernel=False` keeps short queries on the torch path (EngineConfig's switch);
        `all_in_kernel` sends prefill chunks to the kernel too, where each query is computed
        the same way whatever the chunk (engine.model.batch_invariance)."""
        # Plain ints, one tensor each at the end: with a small tensor per sequence, this
        # took 0.38 ms of a 16-sequence decode step's 25 ms (0.08 ms now).
        starts = list(itertools.accumulate(q_lens[:-1], initial=0))
        seqs = [_Seq(*fields) for fields in zip(q_lens, kv_lens, block_tables, starts, strict=True)]
        positions: list[int] = []
        slots: list[int] = []
        for s in seqs:
            span = range(s.kv_len - s.q_len, s.kv_len)
            positions += span
            slots += [s.block_table[p // block_size] * block_size + p % block_size for p in span]
        layout = StepLayout(seqs, block_size, device, dtype)
        in_place = native_kernel and kernel_serves(device, dtype)
        return cls(
            positions=torch.tensor(positions, device=device),
            slot_mapping=torch.tensor(slots, device=device),
            groups=layout.groups(in_place, all_in_kernel),
            layout=layout,
        )


def kernel_serves(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether an in-place paged kernel attends on this device in this dtype: the C kernel
    on a CPU, the Triton one on CUDA."""
    kind = torch.device(device).type
    if kind == "cuda":
        return triton_kernel.available(dtype)
    return kind == "cpu" and kernels.available(dtype)


class _Seq(NamedTuple):
    q_len: int
    kv_len: int
    block_table: list[int]
    start: int
    """Offset of the sequence's first new token in the packed batch."""


def _group(
    seqs: list[_Seq], block_size: int, dtype: torch.dtype, window: int | None = None
) -> AttentionGroup:
    """Padded layout of some sequences attended together; with a `window`, each query
    sees only the last `window` positions up to its own, and blocks wholly behind every
    query's window are not gathered."""
    max_q = max(s.q_len for s in seqs)
    q_offsets = torch.arange(max_q)
    q_valid = q_offsets[None, :] < torch.tensor([s.q_len for s in seqs])[:, None]  # [B, max_q]
    starts = torch.tensor([s.start for s in seqs])
    query_index = torch.where(q_valid, starts[:, None] + q_offsets, 0)
    unpad_index = (torch.arange(len(seqs))[:, None] * max_q + q_offsets)[q_valid]
    token_index = query_index[q_valid]
    fresh = len(seqs) == 1 and seqs[0].q_len == seqs[0].kv_len
    if fresh and (window is None or seqs[0].q_len <= window):  # no cache read, plain causal
        return AttentionGroup(token_index, query_index, unpad_index, None, None)
    first = _first_blocks(seqs, block_size, window)
    max_blocks = max(-(-s.kv_len // block_size) - f for s, f in zip(seqs, first, strict=True))
    tables = [s.block_table[f:] for s, f in zip(seqs, first, strict=True)]
    return AttentionGroup(
        token_index=token_index,
        query_index=query_index,
        unpad_index=unpad_index,
        block_index=_pad_tables(tables, max_blocks).flatten(),
        mask=_mask(seqs, first, max_blocks * block_size, block_size, window, dtype),
    )


def _first_blocks(seqs: list[_Seq], block_size: int, window: int | None) -> list[int]:
    """Each sequence's first block that one of its queries sees: 0 without a window."""
    if window is None:
        return [0] * len(seqs)
    return [max(0, s.kv_len - s.q_len + 1 - window) // block_size for s in seqs]


def _mask(
    seqs: list[_Seq],
    first_blocks: list[int],
    width: int,
    block_size: int,
    window: int | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Additive mask [B, 1, max_q, width] over the gathered positions: 0 where a query
    sees one, -inf elsewhere (in the model's dtype: CPU SDPA ran a 64-sequence decode
    about 1.4x faster with it than with a boolean mask)."""
    q_len_t = torch.tensor([s.q_len for s in seqs])
    kv_len_t = torch.tensor([s.kv_len for s in seqs])
    q_offsets = torch.arange(max(s.q_len for s in seqs))
    query_pos = (kv_len_t - q_len_t)[:, None] + q_offsets  # [B, max_q]
    kv_pos = torch.tensor(first_blocks)[:, None] * block_size + torch.arange(width)  # [B, width]
    visible = (kv_pos[:, None, :] <= query_pos[:, :, None]) & (
        kv_pos[:, None, :] < kv_len_t[:, None, None]
    )  # [B, max_q, width]
    if window is not None:
        visible &= kv_pos[:, None, :] > query_pos[:, :, None] - window
    visible[:, :, 0] |= ~(q_offsets[None, :] < q_len_t[:, None])  # padded rows: not all -inf
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
    return mask.unsqueeze(1)


def _kernel_group(
    seqs: list[_Seq], block_size: int, whole_batch: bool, device: torch.device | str
) -> KernelGroup:
    """The kernel's view of `seqs`; `whole_batch`: they are every sequence of the step."""
    # Query j of a sequence with q_len new tokens sees all but its last q_len - 1 - j.
    visible = torch.tensor([s.kv_len - s.q_len + 1 + j for s in seqs for j in range(s.q_len)])
    max_blocks = -(-max(s.kv_len for s in seqs) // block_size)
    rows = None if whole_batch else [s.start + j for s in seqs for j in range(s.q_len)]
    on_cpu = torch.device(device).type == "cpu"
    return KernelGroup(
        token_index=None if rows is None else torch.tensor(rows, device=device),
        block_tables=_pad_tables([s.block_table for s in seqs], max_blocks).to(device),
        query_seq=torch.tensor(
            [b for b, s in enumerate(seqs) for _ in range(s.q_len)], device=device
        ),
        visible=visible.to(device),
        block_size=block_size,
        thread_bounds=kernels.query_bounds(visible, torch.get_num_threads()) if on_cpu else None,
    )


def _pad_tables(block_tables: list[list[int]], width: int) -> torch.Tensor:
    """Block tables cut or 0-padded to `width` (tables may hold lookahead blocks past it)."""
    rows = [table[:width] + [0] * (width - len(table[:width])) for table in block_tables]
    return torch.tensor(rows, dtype=torch.long)


def _to(group: AttentionGroup, device: torch.device | str) -> AttentionGroup:
    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        """The tensor on `device`; None stays None."""
        return None if t is None else t.to(device)

    return AttentionGroup(
        token_index=group.token_index.to(device),
        query_index=group.query_index.to(device),
        unpad_index=group.unpad_index.to(device),
        block_index=move(group.block_index),
        mask=move(group.mask),
    )


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_slots, KVH, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    window: int | None = None,
) -> torch.Tensor:
    """Write this step's K/V into the cache (quantized, where it is), then attend group by
    group (each query to its last `window` positions, where given). An int8 cache holds
    K and V rotated (kv_quant.rotate): the queries are rotated alike and the output
    rotated back."""
    rotated = kv_quant.is_rotated(k_cache)
    if rotated:
        q, k, v = kv_quant.rotate(q), kv_quant.rotate(k), kv_quant.rotate(v)
    kv_quant.write(k_cache, meta.slot_mapping, k)
    kv_quant.write(v_cache, meta.slot_mapping, v)
    out = _attend_groups(q, k, v, k_cache, v_cache, meta.groups_within(window))
    return kv_quant.rotate(out) if rotated else out


def _attend_groups(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    groups: list[Group],
) -> torch.Tensor:
    if len(groups) == 1 and groups[0].token_index is None:
        return groups[0].attend(q, k, v, k_cache, v_cache)  # every token, in order
    out = torch.empty_like(q)
    for group in groups:
        out[group.token_index] = group.attend(q, k, v, k_cache, v_cache)
    return out
