"""Paged attention over a packed batch, in plain torch (the CPU path).

Each step's tokens are packed into one [T] row, sequence after sequence; every
sequence brings `q_len` new tokens and attends to `kv_len` cached positions
(its old context plus the new tokens). The KV cache is one flat array of
slots per layer; a slot is `block_id * block_size + offset`. Attention gathers
each sequence's blocks (whole blocks: one `index_select` of contiguous rows is
several times faster than gathering slot by slot) into a padded batch and runs
one SDPA call, so a step costs one kernel per layer whatever mix of prefills
and decodes it holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AttentionMetadata:
    positions: torch.Tensor  # [T] absolute position of each packed token
    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V is written to
    query_index: torch.Tensor  # [B, max_q] packed-token index of each padded query
    block_index: torch.Tensor  # [B * max_blocks] each sequence's block ids, 0-padded
    mask: torch.Tensor  # [B, 1, max_q, max_blocks * block_size] True where a query may attend
    unpad_index: torch.Tensor  # [T] row of the flattened [B * max_q] output per token

    @classmethod
    def build(
        cls,
        q_lens: list[int],
        kv_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Describe one step: sequence b computes its last `q_lens[b]` of `kv_lens[b]` tokens."""
        max_q, max_kv = max(q_lens), max(kv_lens)
        q_len_t = torch.tensor(q_lens)
        kv_len_t = torch.tensor(kv_lens)
        starts = torch.cumsum(q_len_t, 0) - q_len_t  # packed offset of each sequence
        q_offsets = torch.arange(max_q)
        q_valid = q_offsets[None, :] < q_len_t[:, None]  # [B, max_q]
        query_index = torch.where(q_valid, starts[:, None] + q_offsets, 0)
        query_pos = (kv_len_t - q_len_t)[:, None] + q_offsets  # [B, max_q]

        max_blocks = -(-max_kv // block_size)
        blocks = _pad_tables(block_tables, max_blocks)  # [B, max_blocks]
        kv_pos = torch.arange(max_blocks * block_size)
        mask = (kv_pos[None, None, :] <= query_pos[:, :, None]) & (
            kv_pos[None, None, :] < kv_len_t[:, None, None]
        )
        # Padded query rows would see nothing and give NaN; let them see slot 0.
        mask[:, :, 0] |= ~q_valid
        batch_rows = torch.arange(len(q_lens))[:, None] * max_q + q_offsets
        pos = query_pos[q_valid]
        block_of_query = blocks[torch.arange(len(q_lens)).repeat_interleave(q_len_t), pos // block_size]
        slot_mapping = block_of_query * block_size + pos % block_size
        return cls(
            positions=pos.to(device),
            slot_mapping=slot_mapping.to(device),
            query_index=query_index.to(device),
            block_index=blocks.flatten().to(device),
            mask=mask.unsqueeze(1).to(device),
            unpad_index=batch_rows[q_valid].to(device),
        )


def _pad_tables(block_tables: list[list[int]], width: int) -> torch.Tensor:
    """Block tables cut or 0-padded to `width` (tables may hold lookahead blocks past it)."""
    rows = [table[:width] + [0] * (width - len(table[:width])) for table in block_tables]
    return torch.tensor(rows, dtype=torch.long)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_slots, KVH, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend over each sequence's context."""
    k_cache[meta.slot_mapping] = k
    v_cache[meta.slot_mapping] = v
    q_b = q[meta.query_index].transpose(1, 2)  # [B, H, max_q, D]
    k_b = _gather_blocks(k_cache, meta)  # [B, KVH, max_blocks * block_size, D]
    v_b = _gather_blocks(v_cache, meta)
    out = F.scaled_dot_product_attention(q_b, k_b, v_b, attn_mask=meta.mask, enable_gqa=True)
    num_heads, head_dim = q.shape[1], q.shape[2]
    return out.transpose(1, 2).reshape(-1, num_heads, head_dim)[meta.unpad_index]


def _gather_blocks(cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    num_seqs, kv_len = meta.mask.shape[0], meta.mask.shape[-1]
    num_heads, head_dim = cache.shape[1], cache.shape[2]
    num_blocks = meta.block_index.shape[0] // num_seqs
    rows = cache.view(-1, (kv_len // num_blocks) * num_heads * head_dim)  # one row per block
    gathered = rows.index_select(0, meta.block_index)
    return gathered.view(num_seqs, kv_len, num_heads, head_dim).transpose(1, 2)
