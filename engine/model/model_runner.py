"""All the tensors of a step: the KV cache, the packed batch, the forward pass.

The scheduler says which requests compute how many tokens; the runner packs
those tokens into one row, runs the model once, takes logits only where a
request has caught up with its tokens (the positions that produce new ones),
and has its StepSampler turn them into tokens (engine/model/step_sampler.py),
each request's rows counted for it. Row offsets are laid out here and nowhere else.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from engine.config import EngineConfig
from engine.grammar import GrammarState
from engine.model.attention import AttentionMetadata, kernel_serves
from engine.model.batch_invariance import make_batch_invariant
from engine.model.llama import LayerKV, LlamaForCausalLM
from engine.model.packed_linear import can_pack, pack_linears
from engine.model.step_sampler import StepSampler, guarded
from engine.outputs import RunnerOutput
from engine.pooling import PooledStates
from engine.quant import kv as kv_quant
from engine.request import Request
from engine.sampler import token_logprobs
from engine.scheduler import SchedulerOutput

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackedTokens:
    """One forward pass as any rank runs it: the packed token ids and where each
    sequence's tokens sit (a tensor-parallel worker builds its own attention metadata
    from it, engine.parallel.ranks)."""

    input_ids: list[int]
    q_lens: list[int]
    kv_lens: list[int]
    block_tables: list[list[int]]


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
    prompt_spans: list[PromptSpan] = field(default_factory=list)
    """Prompt tokens to score for requests that asked for prompt logprobs."""
    pool_spans: list[PromptSpan] = field(default_factory=list)
    """Prompt chunks of embedding requests, whose hidden states are pooled."""


class PromptSpan(NamedTuple):
    """Prompt tokens of one request scored (or pooled) this step: the hidden state at packed
    row `first_row + i` belongs to prompt position `first_token + i` (scoring: predicts it)."""

    request: Request
    first_token: int
    first_row: int
    num_tokens: int


class ModelRunner:
    """Owns a model's KV tensors and runs steps over them.

    `execute` is the engine's whole forward-and-sample; `prepare` and
    `compute_logits` alone serve a draft model, which samples on its own.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        config: EngineConfig,
        on_forward: Callable[[PackedTokens], None] | None = None,
    ) -> None:
        """`on_forward` is handed each forward pass's tokens as soon as `prepare` has packed
        them: a tensor-parallel engine's worker ranks run the pass alongside
        (engine.parallel), building their metadata while this rank builds its own."""
        self.model = model
        self.on_forward = on_forward
        self.block_size = config.block_size
        self.device = torch.device(config.device)
        self.dtype = model.embed_tokens.weight.dtype
        self.native_attention = config.native_attention and (
            self.device.type == "cpu" or config.kv_cache_dtype == "auto"
        )
        """Short queries to an in-place paged kernel; on a GPU only over a cache in the
        model's dtype (the Triton kernel reads no codes and scales)."""
        if can_pack(config.device, self.dtype):
            pack_linears(model)
        self.batch_invariant = config.batch_invariant and self._make_batch_invariant(
            config.max_num_batched_tokens
        )
        self.kv_caches = self._allocate_kv_cache(num_blocks, config.kv_cache_dtype)
        self.sampler = StepSampler()
        self.pooled = PooledStates()
        """Embedding requests' hidden states summed so far (engine/pooling.py)."""

    def constrain(self, request: Request, grammar: GrammarState) -> None:
        """Draw `request`'s tokens among those `grammar` allows, from its first on."""
        self.sampler.grammars[request] = grammar

    def release(self, request: Request) -> None:
        """Forget a finished request's matcher or pooled states (a no-op for others)."""
        self.sampler.grammars.pop(request, None)
        self.pooled.release(request)

    def _make_batch_invariant(self, max_rows: int) -> bool:
        """Matmuls at invariant row counts (a step holds at most `max_rows` tokens), every
        query through the paged kernel."""
        if self.device.type != "cpu":
            log.warning("batch invariance holds on CPUs only: off on %s", self.device)
            return False
        if not (self.native_attention and kernel_serves(self.device, self.dtype)):
            log.warning("batch invariance needs the paged-attention kernel: not available")
            return False
        return make_batch_invariant(self.model, self.dtype, max_rows)

    def _allocate_kv_cache(self, num_blocks: int, kv_cache_dtype: str) -> list[LayerKV]:
        args = self.model.args
        storage = kv_quant.storage_dtype(kv_cache_dtype, self.dtype)
        num_slots = num_blocks * self.block_size

        def layer_cache() -> torch.Tensor:
            """An empty cache tensor of one layer's K or V."""
            return kv_quant.allocate(
                num_slots, args.num_kv_heads, args.head_dim, storage, self.device
            )

        return [(layer_cache(), layer_cache()) for _ in range(args.num_layers)]

    @torch.inference_mode()
    def execute(self, scheduled: SchedulerOutput) -> RunnerOutput:
        """One forward pass over the scheduled tokens, then sampling, draft verification,
        any prompt logprobs asked for, and embedding requests' pooling."""
        batch = self.prepare(scheduled.num_new_tokens)
        hidden = self.forward(batch)
        out = RunnerOutput()
        if batch.sampling_requests:
            logits = self._logits(hidden[batch.logits_index])
            out = self.sampler.sample(
                batch.sampling_requests, batch.num_logits_rows, logits, scheduled.drafts
            )
        for span in batch.prompt_spans:
            guarded(span.request, out, self._score_prompt, span, hidden, out)
        for span in batch.pool_spans:
            guarded(span.request, out, _pool, self.pooled, span, hidden, out)
        return out

    def prepare(self, num_new_tokens: dict[Request, int]) -> StepBatch:
        """Pack each request's next `num_new_tokens` tokens (drafts included) into one batch."""
        input_ids: list[int] = []
        q_lens: list[int] = []
        kv_lens: list[int] = []
        tables: list[list[int]] = []
        logits_rows: list[int] = []
        num_rows: list[int] = []
        sampling: list[Request] = []
        prompt_spans: list[PromptSpan] = []
        pool_spans: list[PromptSpan] = []
        for request, num_new in num_new_tokens.items():
            start = request.num_computed_tokens
            if request.params.prompt_logprobs is not None:
                prompt_spans += _prompt_span(request, start, num_new, len(input_ids))
            if request.pooling is not None:
                pool_spans.append(PromptSpan(request, start, len(input_ids), num_new))
            input_ids.extend(_tokens_with_spec(request, start, start + num_new))
            q_lens.append(num_new)
            kv_lens.append(start + num_new)
            tables.append(request.block_ids)
            end = start + num_new
            if end >= request.num_tokens and request.pooling is None:  # caught up: sample
                rows = end - request.num_tokens + 1
                sampling.append(request)
                num_rows.append(rows)
                logits_rows.extend(range(len(input_ids) - rows, len(input_ids)))
        tokens = PackedTokens(input_ids, q_lens, kv_lens, tables)
        if self.on_forward is not None:  # the other ranks build their metadata meanwhile
            self.on_forward(tokens)
        return StepBatch(
            input_ids=torch.tensor(input_ids, device=self.device),
            meta=self._metadata(tokens),
            logits_index=torch.tensor(logits_rows, dtype=torch.long, device=self.device),
            sampling_requests=sampling,
            num_logits_rows=num_rows,
            prompt_spans=prompt_spans,
            pool_spans=pool_spans,
        )

    @torch.inference_mode()
    def compute_logits(self, batch: StepBatch) -> torch.Tensor:
        """fp32 logits [sum(num_logits_rows), vocab], on the CPU where the sampler draws
        (a no-op copy on a CPU device)."""
        return self._logits(self.forward(batch)[batch.logits_index])

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Hidden states [T, hidden] of the batch's tokens, their K/V written to the cache."""
        return self.model(batch.input_ids, batch.meta, self.kv_caches)

    @torch.inference_mode()
    def forward_packed(self, tokens: PackedTokens) -> torch.Tensor:
        """`forward` from the tokens alone: a tensor-parallel worker rank's step."""
        input_ids = torch.tensor(tokens.input_ids, device=self.device)
        return self.model(input_ids, self._metadata(tokens), self.kv_caches)

    def _metadata(self, tokens: PackedTokens) -> AttentionMetadata:
        return AttentionMetadata.build(
            tokens.q_lens, tokens.kv_lens, tokens.block_tables, self.block_size, self.device,
            self.dtype, self.native_attention, all_in_kernel=self.batch_invariant,
        )  # fmt: skip

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden).cpu()

    def _score_prompt(self, span: PromptSpan, hidden: torch.Tensor, out: RunnerOutput) -> None:
        request = span.request
        rows = hidden[span.first_row : span.first_row + span.num_tokens]
        targets = request.token_ids[span.first_token : span.first_token + span.num_tokens]
        num_top = request.params.prompt_logprobs or 0
        out.prompt_logprobs[request] = (
            span.first_token,
            token_logprobs(self._logits(rows), targets, num_top),
        )


def kv_blocks_for_memory(model: LlamaForCausalLM, config: EngineConfig) -> int:
    """KV blocks that `config.kv_cache_memory_gb` holds, in its kv_cache_dtype with the
    scales counted, so a quantized cache gets the blocks it saves."""
    args = model.args
    storage = kv_quant.storage_dtype(config.kv_cache_dtype, config.torch_dtype)
    row = kv_quant.row_bytes(args.head_dim, storage)
    per_block = 2 * args.num_layers * config.block_size * args.num_kv_heads * row
    return max(2, int(config.kv_cache_memory_gb * 2**30) // per_block)


def _pool(pooled: PooledStates, span: PromptSpan, hidden: torch.Tensor, out: RunnerOutput) -> None:
    """Fold an embedding request's chunk into its sum; its vector once the prompt is done."""
    request = span.request
    rows = hidden[span.first_row : span.first_row + span.num_tokens]  # [n, hidden]
    pooled.add(request, span.first_token, rows)
    if span.first_token + span.num_tokens >= len(request.prompt_token_ids):
        out.embeddings[request] = pooled.finish(request)


def _prompt_span(request: Request, start: int, num_new: int, first_row: int) -> list[PromptSpan]:
    """The prompt tokens after `start` that this chunk's positions predict (a position
    predicts the next token; the last prompt token predicts the first output instead)."""
    end = min(start + num_new, len(request.prompt_token_ids) - 1)
    return [PromptSpan(request, start + 1, first_row, end - start)] if end > start else []


def _tokens_with_spec(request: Request, start: int, end: int) -> list[int]:
    if end <= request.num_tokens:
        return request.token_ids[start:end]
    return (request.token_ids + request.spec_token_ids)[start:end]
