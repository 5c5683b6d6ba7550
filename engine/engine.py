"""The synchronous engine: requests in, one `step()` at a time, deltas out.

One step is: (propose drafts,) schedule, pack and run the model, sample or
verify, then append tokens, roll back draft lookahead, detokenize and check
stops. `engine.async_engine.AsyncLLMEngine` drives it from a thread.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer, StopStringFilter
from engine.kv_cache import KVCacheManager
from engine.loader import load_model
from engine.model_runner import ModelRunner
from engine.outputs import EngineStats, RequestOutput
from engine.request import Request
from engine.sampler import SampleRow, sample
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.spec_decode import build_speculator

_RATE_WINDOW_S = 10.0


@dataclass
class _Tracked:
    """A live request with its output-side state."""

    request: Request
    detokenizer: IncrementalDetokenizer
    stop_filter: StopStringFilter
    generator: torch.Generator
    arrival_s: float = field(default_factory=time.monotonic)
    queue_time_s: float | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.model, self.tokenizer = load_model(config)
        args = self.model.args
        self.max_model_len = min(
            config.max_model_len or args.max_position_embeddings, args.max_position_embeddings
        )
        self.eos_token_ids = _eos_token_ids(self.tokenizer)
        num_blocks = config.num_kv_blocks or self._blocks_for_memory(config)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, num_blocks, config.block_size, config.device)
        self.speculator = build_speculator(config, num_blocks)
        self.requests: dict[str, _Tracked] = {}
        self._seed_source = torch.Generator().manual_seed(config.seed)
        self._recent_tokens: deque[tuple[float, int]] = deque()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    def _blocks_for_memory(self, config: EngineConfig) -> int:
        per_block = ModelRunner.bytes_per_block(self.model, config.block_size, config.torch_dtype)
        return max(2, int(config.kv_cache_memory_gb * 2**30) // per_block)

    # ---- requests in and out -------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming the field and the limit; allocates nothing."""
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise ValueError("prompt must not be empty (prompt_token_ids has 0 tokens)")
        if num_prompt >= self.max_model_len:
            raise ValueError(
                f"prompt has {num_prompt} tokens; the context limit max_model_len is "
                f"{self.max_model_len}, which leaves no room to generate"
            )
        if num_prompt + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({num_prompt} tokens) + max_tokens ({params.max_tokens}) = "
                f"{num_prompt + params.max_tokens} exceeds max_model_len ({self.max_model_len})"
            )
        capacity = self.kv.pool.num_blocks * self.kv.block_size
        if num_prompt + params.max_tokens > capacity:
            raise ValueError(
                f"prompt + max_tokens = {num_prompt + params.max_tokens} tokens exceeds the KV "
                f"cache capacity of {capacity} tokens"
            )
        vocab = self.model.args.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt_token_ids must be in [0, {vocab})")

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
    ) -> None:
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        self.validate(prompt_token_ids, params)
        request = Request(request_id, list(prompt_token_ids), params, priority)
        seed = params.seed if params.seed is not None else _draw_seed(self._seed_source)
        self.requests[request_id] = _Tracked(
            request=request,
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_token_ids),
            stop_filter=StopStringFilter(params.stop),
            generator=torch.Generator().manual_seed(seed),
        )
        self.num_prompt_tokens += len(prompt_token_ids)
        self.scheduler.add(request)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; None if it is not live."""
        tracked = self.requests.get(request_id)
        if tracked is None:
            return None
        self._finish(tracked, "abort")
        return self._output(tracked, [], [], "", "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        scheduled = self.scheduler.schedule()
        if not scheduled.num_new_tokens:
            return []
        batch = self.runner.prepare(scheduled.num_new_tokens)
        logits = self.runner.execute(batch)
        for request, num_new in scheduled.num_new_tokens.items():
            request.num_computed_tokens += num_new
            self.kv.cache_full_blocks(request)  # before a finish frees them
            self._note_first_scheduled(self.requests[request.request_id])
        new_tokens = self._sample(batch.sampling_requests, logits, batch.num_logits_rows)
        outputs = [
            self._append(self.requests[request.request_id], *new_tokens[request])
            for request in batch.sampling_requests
        ]
        self._count_generated(sum(len(o.new_token_ids) for o in outputs))
        return outputs

    @staticmethod
    def _note_first_scheduled(tracked: _Tracked) -> None:
        if tracked.queue_time_s is None:
            tracked.queue_time_s = time.monotonic() - tracked.arrival_s

    def _sample(
        self, requests: list[Request], logits: torch.Tensor, num_rows: list[int]
    ) -> dict[Request, tuple[list[int], list[float]]]:
        """New tokens and their logprobs per request: one batched draw for the requests
        without drafts, a verification for each request with some."""
        first_row = torch.tensor([0, *num_rows[:-1]]).cumsum(0).tolist()
        plain = [i for i, r in enumerate(requests) if not r.spec_token_ids]
        rows = [self._sample_row(self.requests[requests[i].request_id]) for i in plain]
        plain_logits = (
            logits if len(plain) == len(logits) else logits[[first_row[i] for i in plain]]
        )
        token_ids, logprobs = sample(plain_logits, rows) if plain else ([], [])
        out = {
            requests[i]: ([t], [lp]) for i, t, lp in zip(plain, token_ids, logprobs, strict=True)
        }
        for i, request in enumerate(requests):
            if request.spec_token_ids:
                assert self.speculator is not None
                own_rows = logits[first_row[i] : first_row[i] + num_rows[i]]
                row = self._sample_row(self.requests[request.request_id])
                out[request] = self.speculator.verify(request, own_rows, row)
        return out

    def _sample_row(self, tracked: _Tracked) -> SampleRow:
        request, params = tracked.request, tracked.request.params
        return SampleRow(
            params=params,
            generator=tracked.generator,
            seen_token_ids=request.token_ids if params.repetition_penalty != 1.0 else [],
            num_output_tokens=request.num_output_tokens,
            banned_until_min_tokens=(
                tuple(self.eos_token_ids) + params.stop_token_ids if params.min_tokens else ()
            ),
        )

    def _append(
        self, tracked: _Tracked, token_ids: list[int], logprobs: list[float]
    ) -> RequestOutput:
        """Append tokens up to the first stop, roll back draft lookahead, emit the text."""
        request = tracked.request
        reason, kept = None, []
        for token_id in token_ids:
            request.append_output_token(token_id)
            kept.append(token_id)
            reason = self._token_stop_reason(request, token_id)
            if reason is not None:
                break
        self._roll_back_lookahead(request)
        text_ids = kept[:-1] if reason == "stop" else kept  # a stop token has no text
        text = tracked.detokenizer.push(text_ids)
        text, hit_stop_string = tracked.stop_filter.push(text, final=reason is not None)
        if hit_stop_string:
            reason = "stop"
        if reason is not None:
            self._finish(tracked, reason)
        return self._output(tracked, kept, logprobs[: len(kept)], text, reason)

    def _roll_back_lookahead(self, request: Request) -> None:
        """Only tokens before the newest one have valid K/V: drop rejected drafts' slots."""
        request.spec_token_ids = []
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        self.kv.trim(request, request.num_computed_tokens)

    def _finish(self, tracked: _Tracked, reason: str) -> None:
        self.requests.pop(tracked.request.request_id)
        self.scheduler.finish(tracked.request, reason)
        if self.speculator is not None:
            self.speculator.release(tracked.request)

    def _token_stop_reason(self, request: Request, token_id: int) -> str | None:
        params = request.params
        if token_id in params.stop_token_ids:
            return "stop"
        if token_id in self.eos_token_ids and not params.ignore_eos:
            return "stop"
        if request.num_output_tokens >= params.max_tokens:
            return "length"
        return None

    def _output(
        self,
        tracked: _Tracked,
        token_ids: list[int],
        logprobs: list[float],
        text: str,
        reason: str | None,
    ) -> RequestOutput:
        request = tracked.request
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=token_ids,
            new_text=text,
            finished=reason is not None,
            finish_reason=reason,
            new_logprobs=logprobs if request.params.logprobs else None,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
            queue_time_s=tracked.queue_time_s,
        )

    # ---- stats ---------------------------------------------------------------

    def _count_generated(self, num_tokens: int) -> None:
        now = time.monotonic()
        self.num_generation_tokens += num_tokens
        self._recent_tokens.append((now, num_tokens))
        while self._recent_tokens and self._recent_tokens[0][0] < now - _RATE_WINDOW_S:
            self._recent_tokens.popleft()

    def stats(self) -> EngineStats:
        recent = self._recent_tokens
        span = (recent[-1][0] - recent[0][0]) if len(recent) > 1 else 0.0
        rate = sum(n for _, n in recent) / span if span > 0 else 0.0
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=self.kv.num_queries,
            prefix_cache_hits=self.kv.num_hits,
            num_preemptions=self.scheduler.num_preemptions,
            generation_tokens_per_s=rate,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            **self._spec_stats(),
        )

    def _spec_stats(self) -> dict:
        spec = self.speculator
        if spec is None:
            return {}
        return dict(
            spec_num_drafts=spec.num_drafts,
            spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
            spec_accepted_per_pos=list(spec.accepted_per_pos),
        )


def _eos_token_ids(tokenizer) -> set[int]:
    eos = tokenizer.eos_token_id
    return {eos} if eos is not None else set()


def _draw_seed(source: torch.Generator) -> int:
    return int(torch.randint(0, 2**62, (1,), generator=source))
