"""The synchronous engine: requests in, one `step()` at a time, deltas out.

A step is vLLM v1's loop: the speculator proposes drafts, the scheduler hands
out the token budget (`SchedulerOutput`), the runner computes and samples
(`RunnerOutput`), the scheduler advances request state, and the engine turns
the new tokens into text deltas. `engine.async_engine.AsyncLLMEngine` drives
it from a thread.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer, StopStringFilter
from engine.grammar import GrammarCompiler, GrammarState
from engine.kv_cache import KVCacheManager
from engine.model.model_runner import ModelRunner
from engine.outputs import (
    EngineStats,
    FirstTokenTimes,
    RequestOutput,
    RunnerOutput,
    TokenLogprob,
)
from engine.prompt_limits import PromptLimits
from engine.quant.prepare import prepare_model
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.spec_decode import DraftModelProposer, Proposal, Speculator, build_speculator
from engine.step_cost import StepCostModel

log = logging.getLogger(__name__)

_RATE_WINDOW_S = 10.0
CALIBRATION_STEPS = 4
"""Output tokens of each start-up calibration request (EngineConfig.calibrate_step_cost)."""


@dataclass
class _LiveSequence:
    """A live request with its output-side state: text so far and stop strings."""

    request: Request
    detokenizer: IncrementalDetokenizer
    stop_filter: StopStringFilter
    prompt_logprobs: dict[int, TokenLogprob] = field(default_factory=dict)
    """Scores of prompt tokens by index, gathered over the prompt's chunks (a chunk
    recomputed after preemption overwrites its own)."""


class LLMEngine:
    """One model, one KV cache, continuous batching: `add_request`, then `step()` until done.

    Not thread-safe; `AsyncLLMEngine` serialises access through its loop thread.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model, self.tokenizer = prepare_model(config)
        args = self.model.args
        self.max_model_len = min(
            config.max_model_len or args.max_position_embeddings, args.max_position_embeddings
        )
        self.eos_token_ids = _eos_token_ids(self.tokenizer)
        self.grammars = GrammarCompiler(self.tokenizer, args.vocab_size, self.eos_token_ids)
        num_blocks = config.num_kv_blocks or ModelRunner.blocks_for_memory(self.model, config)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.step_cost = StepCostModel()
        self.scheduler = Scheduler(
            self.kv, config.max_num_seqs, config.max_num_batched_tokens, self.step_cost
        )
        self.runner = ModelRunner(self.model, num_blocks, config)
        self._seed_source = random.Random(config.seed)
        self.speculator = _speculator(config, num_blocks)
        self.requests: dict[str, _LiveSequence] = {}
        self._recent_tokens: deque[tuple[float, int]] = deque()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        if config.calibrate_step_cost:
            self._calibrate_step_cost()

    # ---- requests in and out -------------------------------------------------

    @property
    def limits(self) -> PromptLimits:
        """What a request may ask of this engine (its context, cache and vocabulary)."""
        return PromptLimits(
            self.max_model_len,
            self.kv.pool.num_blocks * self.kv.block_size,
            self.model.args.vocab_size,
        )

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming the field and the limit; allocates nothing."""
        self.limits.check(prompt_token_ids, params)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        tpot_target_s: float | None = None,
    ) -> None:
        """Queue a request (validated first; ValueError says what is wrong). `tpot_target_s`
        is its time-per-token target, which the scheduler keeps steps within. A grammar is
        compiled here (cached by content), never inside a step."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        self.validate(prompt_token_ids, params)
        grammar = self._grammar_state(params)
        seed = params.seed if params.seed is not None else self._seed_source.getrandbits(63)
        request = Request(
            request_id, list(prompt_token_ids), params, priority, tpot_target_s, self.eos_token_ids,
            sampling_seed=seed,
        )  # fmt: skip
        self.requests[request_id] = _LiveSequence(
            request=request,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, params.skip_special_tokens
            ),
            stop_filter=StopStringFilter(params.stop, params.include_stop_str_in_output),
        )
        self.num_prompt_tokens += len(prompt_token_ids)
        if grammar is not None:
            self.runner.constrain(request, grammar)
        self.scheduler.add(request)

    def _grammar_state(self, params: SamplingParams) -> GrammarState | None:
        """A fresh matcher of the request's grammar; ValueError when it cannot compile."""
        if params.grammar is None:
            return None
        try:
            return GrammarState(self.grammars.compile(params.grammar))
        except ValueError as error:
            kind = params.grammar.kind
            raise ValueError(f"the grammar ({kind}) cannot be used: {error}") from None

    def _calibrate_step_cost(self) -> None:
        """Run throwaway requests shaped to pin the fit's three terms: one sequence alone
        (base), a full batch of decodes (per sequence), a full prefill chunk (per token).
        Only the fit keeps a trace: the counters are reset after."""
        rng = random.Random(0)
        vocab = self.model.args.vocab_size
        params = SamplingParams(max_tokens=CALIBRATION_STEPS, temperature=0, ignore_eos=True)
        chunk = min(self.config.max_num_batched_tokens, self.max_model_len - CALIBRATION_STEPS)
        for num_seqs, prompt_len in ((1, 8), (self.config.max_num_seqs, 8), (1, chunk)):
            for i in range(num_seqs):
                prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
                self.add_request(f"calibrate-{num_seqs}-{prompt_len}-{i}", prompt, params)
            while self.has_unfinished():
                self.step()
        self._reset_counters()

    def _reset_counters(self) -> None:
        self.num_prompt_tokens = self.num_generation_tokens = 0
        self._recent_tokens.clear()
        self.kv.num_queries = self.kv.num_hits = 0
        self.scheduler.num_preemptions = 0
        if self.speculator is not None:
            self.speculator.reset_counters()

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; None if it is not live."""
        tracked = self.requests.get(request_id)
        if tracked is None:
            return None
        self.scheduler.finish(tracked.request, "abort")
        self._release(tracked.request)
        return self._output(tracked, [], None, "", "abort")

    def has_unfinished(self) -> bool:
        """Anything queued or running: whether `step()` has work."""
        return self.scheduler.has_unfinished()

    def run_all(
        self,
        requests: Sequence[tuple[list[int], SamplingParams]],
        on_finish: Callable[[], None] = lambda: None,
    ) -> list[list[RequestOutput]]:
        """Offline use (distillation, labelling): queue every (prompt, params) at once, step
        until all finish, and return each request's deltas in order. `on_finish` is called
        as each request ends (a progress bar)."""
        deltas: dict[str, list[RequestOutput]] = {}
        for index, (prompt, params) in enumerate(requests):
            self.add_request(f"offline-{index}", prompt, params)
            deltas[f"offline-{index}"] = []
        while self.has_unfinished():
            for output in self.step():
                deltas[output.request_id].append(output)
                if output.finished:
                    on_finish()
        return list(deltas.values())

    # ---- the step ------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration of continuous batching; a delta for every request that produced tokens.

        A failure of the forward pass fails the requests of this step (their blocks freed);
        a failure tied to one request fails that request; the engine goes on either way.
        """
        scheduled = self.scheduler.schedule(self._propose())
        if not scheduled.num_new_tokens:
            return []
        result = self._execute(scheduled)
        self._record(scheduled, result)
        kept = self.scheduler.update(scheduled, result)
        outputs = [self._emit(request, token_ids, result) for request, token_ids in kept.items()]
        self._count_generated(sum(len(o.new_token_ids) for o in outputs))
        return outputs

    def _execute(self, scheduled: SchedulerOutput) -> RunnerOutput:
        """Run the step and time it for the cost model; a failed forward pass fails every
        request of the step (nothing it computed is kept)."""
        start_s = time.perf_counter()
        try:
            result = self.runner.execute(scheduled)
        except Exception as exc:  # noqa: BLE001 - the step's requests fail, the engine lives
            log.exception("forward pass failed")
            error = f"forward pass failed: {exc!r}"
            return RunnerOutput(failed=dict.fromkeys(scheduled.num_new_tokens, error))
        seconds = time.perf_counter() - start_s
        self.step_cost.observe(
            len(scheduled.num_new_tokens), scheduled.total_tokens, seconds,
            scheduled.attended_positions,
        )  # fmt: skip
        if self.speculator is not None:
            self.speculator.observe_step(scheduled.num_new_tokens, scheduled.drafts, seconds)
        return result

    def _record(self, scheduled: SchedulerOutput, result: RunnerOutput) -> None:
        """What the step leaves outside the scheduler: the speculator's counts, and the
        prompt scores of requests that asked for them (kept until their first output)."""
        if self.speculator is not None:
            self.speculator.record(scheduled.drafts, result)
        for request, (first, scores) in result.prompt_logprobs.items():
            self.requests[request.request_id].prompt_logprobs.update(enumerate(scores, first))

    def _propose(self) -> dict[Request, Proposal]:
        """Drafts for this step; a failing proposer costs the speedup, never the requests."""
        if self.speculator is None:
            return {}
        try:
            return self.speculator.propose(self.scheduler.running)
        except Exception:  # noqa: BLE001 - speculation is optional
            log.exception("draft proposal failed; this step runs without drafts")
            return {}

    def _fail(self, request: Request, error: str) -> RequestOutput:
        """End `request` with finish_reason `error` and free everything it holds."""
        log.error("request %s failed: %s", request.request_id, error)
        self.scheduler.finish(request, "error")
        tracked = self.requests[request.request_id]
        self._release(request)
        return self._output(tracked, [], None, "", "error", error)

    def _emit(self, request: Request, token_ids: list[int], result: RunnerOutput) -> RequestOutput:
        """The request's delta; a failure here (detokenizing, stop strings) fails it alone."""
        if request in result.failed:
            return self._fail(request, result.failed[request])
        try:
            return self._text_delta(request, token_ids, result)
        except Exception as exc:  # noqa: BLE001 - one request's text must not stop the batch
            log.exception("output processing failed for request %s", request.request_id)
            return self._fail(request, f"output processing failed: {exc!r}")

    def _text_delta(
        self, request: Request, token_ids: list[int], result: RunnerOutput
    ) -> RequestOutput:
        """Detokenize the kept tokens, apply stop strings, and release a finished request."""
        tracked = self.requests[request.request_id]
        reason = request.finish_reason
        # A stop token's text is kept only when asked (vLLM's rule)
        drop_stop_token = reason == "stop" and not request.params.include_stop_str_in_output
        text_ids = token_ids[:-1] if drop_stop_token else token_ids
        text = tracked.detokenizer.push(text_ids)
        text, hit_stop_string = tracked.stop_filter.push(text, final=reason is not None)
        if hit_stop_string:
            reason = "stop"
            self.scheduler.finish(request, reason)
        if reason is not None:
            self._release(request)
        logprobs = result.logprobs.get(request)
        return self._output(
            tracked, token_ids, logprobs and logprobs[: len(token_ids)], text, reason
        )

    def _release(self, request: Request) -> None:
        """Forget a finished request everywhere outside the scheduler."""
        self.requests.pop(request.request_id)
        self.runner.release(request)
        if self.speculator is not None:
            self.speculator.release(request)

    def _output(
        self,
        tracked: _LiveSequence,
        token_ids: list[int],
        logprobs: list[TokenLogprob] | None,
        text: str,
        reason: str | None,
        error: str | None = None,
    ) -> RequestOutput:
        request = tracked.request
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=token_ids,
            new_text=text,
            finished=reason is not None,
            finish_reason=reason,
            new_logprobs=logprobs,
            prompt_logprobs=_prompt_logprobs(tracked, token_ids),
            num_prompt_tokens=len(request.prompt_token_ids),
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
            queue_time_s=request.queue_time_s,
            first_token_times=_first_token_times(request, token_ids),
            error=error,
        )

    # ---- stats ---------------------------------------------------------------

    def _count_generated(self, num_tokens: int) -> None:
        now = time.monotonic()
        self.num_generation_tokens += num_tokens
        self._recent_tokens.append((now, num_tokens))
        while self._recent_tokens and self._recent_tokens[0][0] < now - _RATE_WINDOW_S:
            self._recent_tokens.popleft()

    def stats(self) -> EngineStats:
        """A snapshot of load and counters for routing, autoscaling and metrics."""
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
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            num_kv_blocks=self.kv.pool.num_blocks,
            kv_max_num_seqs=self.kv.num_seqs_fitting(self.max_model_len),
            kv_cache_dtype=self.config.kv_cache_dtype,
            step_cost=self.step_cost.coefficients(),
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


def _speculator(config: EngineConfig, num_blocks: int) -> Speculator | None:
    """The speculator for `config.spec_decode`; a draft model is loaded here and handed over."""
    spec = config.spec_decode
    if spec is None:
        return None
    if spec.method == "ngram":
        return build_speculator(spec)
    draft_config = dataclasses.replace(
        config, model=spec.draft_model or config.model, spec_decode=None
    )
    draft_model, _ = prepare_model(draft_config, num_layers=spec.draft_num_layers)
    runner = ModelRunner(draft_model, num_blocks, draft_config)
    kv = KVCacheManager(num_blocks, config.block_size, enable_prefix_caching=False)
    return build_speculator(spec, DraftModelProposer(runner, kv))


def _prompt_logprobs(
    tracked: _LiveSequence, token_ids: list[int]
) -> list[TokenLogprob | None] | None:
    """The prompt's scores, in the request's first output with tokens (else None)."""
    request = tracked.request
    if request.params.prompt_logprobs is None or not _is_first(request, token_ids):
        return None
    scores = tracked.prompt_logprobs
    return [None, *(scores[i] for i in range(1, len(request.prompt_token_ids)))]


def _eos_token_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    eos = tokenizer.eos_token_id
    return frozenset({eos}) if isinstance(eos, int) else frozenset()


def _is_first(request: Request, token_ids: list[int]) -> bool:
    """This delta holds the request's first output token."""
    return bool(token_ids) and len(token_ids) == request.num_output_tokens


def _first_token_times(request: Request, token_ids: list[int]) -> FirstTokenTimes | None:
    """On the delta with the first token: the request's monotonic arrival and scheduling as
    wall-clock instants, now being its first token's (the front fills in its own two)."""
    if not _is_first(request, token_ids):
        return None
    now_s, wall_s = time.monotonic(), time.time()
    scheduled_s = request.first_scheduled_time_s or now_s
    return FirstTokenTimes(
        sent_s=None,
        arrived_s=wall_s - (now_s - request.arrival_time_s),
        scheduled_s=wall_s - (now_s - scheduled_s),
        first_token_s=wall_s,
    )
