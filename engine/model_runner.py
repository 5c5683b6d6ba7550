"""All the tensors of a step: the KV cache, the packed batch, the forward pass, sampling.

The scheduler says which requests compute how many tokens; the runner packs
those tokens into one row, runs the model once, and takes logits only where a
request has caught up with its tokens (the positions that produce new ones).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata
from engine.model import LlamaForCausalLM
from engine.packed_linear import can_pack, pack_linears
from engine.request import Request


@dataclass(frozen=True)
class StepBatch:
    """The packed inputs of one forward pass."""

    input_ids: torch.Tensor  # [T]
    meta: AttentionMetadata
    logits_index: torch.Tensor  # [N] packed rows whose logits are needed
    sampling_requests: list[Request]
    """Requests that produce tokens this step, in order."""
    num_logits_rows: list[int]
    """Logits rows of each sampling request: 1, plus one per draft token it verifies."""


class ModelRunner:
    def __init__(
        self, model: LlamaForCausalLM, num_blocks: int, block_size: int, device: str
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        self.dtype = model.embed_tokens.weight.dtype
        if can_pack(device, self.dtype):
            pack_linears(model)
        self._allocate_kv_cache(num_blocks)

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        args = self.model.args
        shape = (num_blocks * self.block_size, args.num_kv_heads, args.head_dim)
        for attention in self.model.attention_layers():
            attention.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            attention.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)

    @staticmethod
    def bytes_per_block(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
        args = model.args
        elem = torch.tensor([], dtype=dtype).element_size()
        return 2 * args.num_layers * block_size * args.num_kv_heads * args.head_dim * elem

    def prepare(self, num_new_tokens: dict[Request, int]) -> StepBatch:
        input_ids: list[int] = []
        q_lens: list[int] = []
        kv_lens: list[int] = []
        tables: list[list[int]] = []
        logits_rows: list[int] = []
        num_rows: list[int] = []
        sampling: list[Request] = []
        for request, num_new in num_new_tokens.items():
            start = request.num_computed_tokens
            input_ids.extend(_tokens_with_spec(request, start, start + num_new))
            q_lens.append(num_new)
            kv_lens.append(start + num_new)
            tables.append(request.block_ids)
            end = start + num_new
            if end >= request.num_tokens:  # caught up: the last real token and any drafts
                rows = end - request.num_tokens + 1
                sampling.append(request)
                num_rows.append(rows)
                logits_rows.extend(range(len(input_ids) - rows, len(input_ids)))
        meta = AttentionMetadata.build(
            q_lens, kv_lens, tables, self.block_size, self.device, self.dtype
        )
        return StepBatch(
            input_ids=torch.tensor(input_ids, device=self.device),
            meta=meta,
            logits_index=torch.tensor(logits_rows, dtype=torch.long, device=self.device),
            sampling_requests=sampling,
            num_logits_rows=num_rows,
        )

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> torch.Tensor:
        """fp32 logits [sum(num_logits_rows), vocab], on the CPU where the sampler's
        per-request generators live (a no-op copy on a CPU device)."""
        hidden = self.model(batch.input_ids, batch.meta)
        return self.model.compute_logits(hidden[batch.logits_index]).cpu()


def _tokens_with_spec(request: Request, start: int, end: int) -> list[int]:
    if end <= request.num_tokens:
        return request.token_ids[start:end]
    return (request.token_ids + request.spec_token_ids)[start:end]
