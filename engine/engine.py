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

from transformers import PreTrainedTokenizerBase

from engine.config import EngineConfig
from engine.grammar import GrammarCompiler, GrammarState
from engine.kv_cache import KVCacheManager
from engine.live_sequence import LiveSequence
from engine.model.llama import LlamaForCausalLM
from engine.model.model_runner import ModelRunner, kv_blocks_for_memory
from engine.outputs import EngineStats, RequestOutput, RunnerOutput
from engine.parallel.errors import RankLost
from engine.parallel.ranks import WorkerRanks
from engine.parallel.shard import check_shardable, shard_model
from engine.prompt_limits import PromptLimits
from engine.quant.prepare import prepare_model
from engine.request import Request, Urgency
from engine.sampling_params import PoolingParams, SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.spec_decode import DraftModelProposer, Proposal, Speculator, build_speculator
from engine.step_cost import StepClock, StepCostModel, StepWork
from engine.token_counters import TokenCounters

log = logging.getLogger(__name__)

CALIBRATION_STEPS = 4
"""Output tokens of each start-up calibration request (EngineConfig.calibrate_step_cost)."""


class LLMEngine:
    """One model, one KV cache, continuous batching: `add_request`, then `step()` until done.

    Not thread-safe; `AsyncLLMEngine` serialises access through its loop thread.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model, self.tokenizer = prepare_model(config)
        self.model, self.ranks = _split_over_ranks(config, model)
        args = self.model.args
        self.max_model_len = min(
            config.max_model_len or args.max_position_embeddings, args.max_position_embeddings
        )
        self.eos_token_ids = _eos_token_ids(self.tokenizer)
        self.grammars = GrammarCompiler(self.tokenizer, args.vocab_size, self.eos_token_ids)
        num_blocks = config.num_kv_blocks or kv_blocks_for_memory(self.model, config)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.limits = PromptLimits(
            self.max_model_len, num_blocks * config.block_size, args.vocab_size
        )
        """What a request may ask of this engine (its context, cache and vocabulary)."""
        self.step_cost = StepCostModel()
        """What a step costs, timed by `clock`: scheduling, drafting, the forward pass and
        making the outputs."""
        self.clock = StepClock()
        self.scheduler = Scheduler(
            self.kv, config.max_num_seqs, config.max_num_batched_tokens, self.step_cost,
            prefill_step_limit_s=config.prefill_step_limit_s,
        )  # fmt: skip
        if self.ranks is not None:
            self.ranks.start_runners(num_blocks)
        self.runner = ModelRunner(
            self.model, num_blocks, config, self.ranks.send_step if self.ranks else None
        )
        self._seed_source = random.Random(config.seed)
        self.speculator = _speculator(config, num_blocks)
        self.requests: dict[str, LiveSequence] = {}
        self.counters = TokenCounters()
        if config.calibrate_step_cost:
            _calibrate_step_cost(self)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        tpot_target_s: float | None = None,
        pooling: PoolingParams | None = None,
    ) -> None:
        """Queue a request, checked against `limits` first (ValueError says what is wrong).
        `tpot_target_s` is its time-per-token target, which the scheduler keeps steps within;
        `pooling` makes it an embedding request (engine/pooling.py)."""
        self.limits.check(prompt_token_ids, params)
        urgency = Urgency(priority, tpot_target_s)
        self.enqueue(request_id, prompt_token_ids, params, urgency, pooling)

    def enqueue(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        urgency: Urgency,
        pooling: PoolingParams | None = None,
    ) -> None:
        """Queue a request its caller already checked against `limits` (the async front does,
        before the request crosses to the loop). A grammar is compiled here (cached by
        content), never inside a step; ValueError when it cannot be, or the id is taken."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        grammar = _grammar_state(self.grammars, params)
        seed = params.seed if params.seed is not None else self._seed_source.getrandbits(63)
        request = Request(
            request_id, list(prompt_token_ids), params, urgency.priority, urgency.tpot_target_s,
            self.eos_token_ids, sampling_seed=seed, pooling=pooling,
        )  # fmt: skip
        self.requests[request_id] = LiveSequence.start(request, self.tokenizer)
        self.counters.count_prompt(len(prompt_token_ids))
        if grammar is not None:
            self.runner.constrain(request, grammar)
        self.scheduler.add(request)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; None if it is not live."""
        tracked = self.requests.get(request_id)
        return None if tracked is None else self._end(tracked.request, "abort")

    def close(self) -> None:
        """Stop the tensor-parallel worker ranks, if any; the engine cannot step after."""
        if self.ranks is not None:
            self.ranks.close()

    def has_unfinished(self) -> bool:
        """Anything queued or running: whether `step()` has work."""
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One iteration of continuous batching; a delta for every request that produced tokens.

        A failure of the forward pass fails the requests of this step (their blocks freed);
        a failure tied to one request fails that request; the engine goes on either way.
        """
        began_s = self.clock.start()
        scheduled = self.scheduler.schedule(self._propose())
        if not scheduled.num_new_tokens:
            self.clock.stop(work_left=False)
            return []
        work = scheduled.work  # before the update advances the requests
        result = self._execute(scheduled)
        kept = self.scheduler.update(scheduled, result)
        outputs = [self._emit(request, token_ids, result) for request, token_ids in kept.items()]
        self.counters.count_step(sum(len(o.new_token_ids) for o in outputs), work.prompt_tokens)
        ended_s = self.clock.stop(work_left=self.has_unfinished())
        if len(result.failed) < len(scheduled.num_new_tokens):  # not a failed forward pass
            self._learn_cost(scheduled, work, ended_s - began_s)
        return outputs

    def _execute(self, scheduled: SchedulerOutput) -> RunnerOutput:
        """Run the step and keep what it leaves outside the scheduler; a failed forward
        pass fails every request of the step (nothing it computed is kept)."""
        try:
            result = self.runner.execute(scheduled)
        except RankLost:  # no later step can run either: the engine loop stops for good
            raise
        except Exception as exc:  # noqa: BLE001 - the step's requests fail, the engine lives
            log.exception("forward pass failed")
            error = f"forward pass failed: {exc!r}"
            return RunnerOutput(failed=dict.fromkeys(scheduled.num_new_tokens, error))
        if self.speculator is not None:
            self.speculator.record(scheduled.drafts, result)
        for request, (first, scores) in result.prompt_logprobs.items():
            self.requests[request.request_id].prompt_logprobs.update(enumerate(scores, first))
        return result

    def _learn_cost(self, scheduled: SchedulerOutput, work: StepWork, seconds: float) -> None:
        """The step's time (to its outputs made), over the `work` the scheduler priced it
        at, to the cost model and the speculator."""
        self.step_cost.observe(work, seconds)
        if self.speculator is not None:
            self.speculator.observe_step(scheduled.num_new_tokens, scheduled.drafts, seconds)

    def _propose(self) -> dict[Request, Proposal]:
        """Drafts for this step (none without speculation)."""
        return self.speculator.propose(self.scheduler.running) if self.speculator else {}

    def _end(self, request: Request, reason: str, error: str | None = None) -> RequestOutput:
        """Its last delta: `request` finished early (`abort`, or `error`), its hold freed."""
        if error is not None:
            log.error("request %s failed: %s", request.request_id, error)
        tracked = self.requests[request.request_id]
        self.scheduler.finish(request, reason)
        self._release(request)
        return tracked.output([], None, "", reason, error=error)

    def _emit(self, request: Request, token_ids: list[int], result: RunnerOutput) -> RequestOutput:
        """The request's delta: its kept tokens detokenized, stop strings applied, released
        once finished. A failure in detokenizing or stop strings fails this request alone."""
        if request in result.failed:
            return self._end(request, "error", result.failed[request])
        tracked = self.requests[request.request_id]
        try:
            text, hit_stop_string = tracked.push(token_ids)
        except Exception as exc:  # noqa: BLE001 - one request's text must not stop the batch
            log.exception("output processing failed for request %s", request.request_id)
            return self._end(request, "error", f"output processing failed: {exc!r}")
        reason = "stop" if hit_stop_string else request.finish_reason
        if hit_stop_string:
            self.scheduler.finish(request, reason)
        if reason is not None:
            self._release(request)
        logprobs = result.logprobs.get(request)
        logprobs = logprobs and logprobs[: len(token_ids)]
        return tracked.output(token_ids, logprobs, text, reason, result.embeddings.get(request))

    def _release(self, request: Request) -> None:
        """Forget a finished request everywhere outside the scheduler."""
        self.requests.pop(request.request_id)
        self.runner.release(request)
        if self.speculator is not None:
            self.speculator.release(request)

    def stats(self) -> EngineStats:
        """A snapshot of load and counters for routing, autoscaling and metrics."""
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preemptions=self.scheduler.num_preemptions,
            generation_tokens_per_s=self.counters.generation_rate(),
            prompt_tokens_computed_per_s=self.counters.prompt_compute_rate(),
            num_prompt_tokens=self.counters.num_prompt_tokens,
            num_generation_tokens=self.counters.num_generation_tokens,
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            kv_cache_dtype=self.config.kv_cache_dtype,
            seeded_reproducible=self.runner.batch_invariant,
            step_cost=self.step_cost.coefficients(),
            **_kv_stats(self.kv, self.max_model_len),
            **_spec_stats(self.speculator),
        )


def _kv_stats(kv: KVCacheManager, max_model_len: int) -> dict:
    """The KV cache's load, prefix-cache counters and capacity as EngineStats fields."""
    return dict(
        kv_cache_usage=kv.usage,
        prefix_cache_queries=kv.num_queries,
        prefix_cache_hits=kv.num_hits,
        num_kv_blocks=kv.pool.num_blocks,
        kv_max_num_seqs=kv.num_seqs_fitting(max_model_len),
    )


def _spec_stats(spec: Speculator | None) -> dict:
    """The speculator's counters as EngineStats fields (none without speculation)."""
    if spec is None:
        return {}
    return dict(
        spec_num_drafts=spec.num_drafts,
        spec_num_draft_tokens=spec.num_draft_tokens,
        spec_num_accepted_tokens=spec.num_accepted_tokens,
        spec_num_decode_rows=spec.num_decode_rows,
        spec_accepted_per_pos=list(spec.accepted_per_pos),
    )


def _calibrate_step_cost(engine: LLMEngine) -> None:
    """Run throwaway requests shaped to pin the fit's three terms: one sequence alone
    (base), a full batch of decodes (per sequence), a full prefill chunk (per token).
    Only the fit keeps a trace: the counters are reset after."""
    rng = random.Random(0)
    vocab = engine.model.args.vocab_size
    config = engine.config
    params = SamplingParams(max_tokens=CALIBRATION_STEPS, temperature=0, ignore_eos=True)
    chunk = min(config.max_num_batched_tokens, engine.max_model_len - CALIBRATION_STEPS)
    for num_seqs, prompt_len in ((1, 8), (config.max_num_seqs, 8), (1, chunk)):
        for i in range(num_seqs):
            prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
            engine.add_request(f"calibrate-{num_seqs}-{prompt_len}-{i}", prompt, params)
        while engine.has_unfinished():
            engine.step()
    engine.counters.reset()
    engine.kv.num_queries = engine.kv.num_hits = 0
    engine.scheduler.num_preemptions = 0
    if engine.speculator is not None:
        engine.speculator.reset_counters()


def _grammar_state(grammars: GrammarCompiler, params: SamplingParams) -> GrammarState | None:
    """A fresh matcher of the request's grammar; ValueError when it cannot compile."""
    if params.grammar is None:
        return None
    try:
        return GrammarState(grammars.compile(params.grammar))
    except ValueError as error:
        raise ValueError(f"the grammar ({params.grammar.kind}) cannot be used: {error}") from None


def _split_over_ranks(
    config: EngineConfig, model: LlamaForCausalLM
) -> tuple[LlamaForCausalLM, WorkerRanks | None]:
    """Rank 0's slice of the model and tensor parallelism's worker ranks, started once the
    model is known to split; with tensor_parallel_size 1 the whole model and no ranks."""
    if config.tensor_parallel_size == 1:
        return model, None
    check_shardable(model, config.tensor_parallel_size)
    ranks = WorkerRanks(config, model.args.hidden_size)
    return shard_model(model, config.tensor_parallel_size, 0, ranks.all_reduce), ranks


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


def _eos_token_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    eos = tokenizer.eos_token_id
    return frozenset({eos}) if isinstance(eos, int) else frozenset()
