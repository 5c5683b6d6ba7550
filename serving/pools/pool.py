"""The pool deployment: one engine per replica, streaming token deltas to the ingress.

A pool is a config entry (serving.config.PoolConfig), not a subclass: the
interactive and offline pools are this class with different engine settings.
The engine class is injectable so deployment tests run a fake without a model.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol, cast

from ray import serve

from engine.config import EngineConfig
from engine.model.students import StudentMissing
from engine.outputs import EngineStats, RequestOutput
from engine.request import DEFAULT_URGENCY, Urgency
from engine.sampling_params import MEAN_POOLING, PoolingParams, SamplingParams
from policies.router_choice import ServedStudent
from serving.pools.served_student import pin_student
from serving.pools.student_wait import wait_for_student, waiting_reason

log = logging.getLogger(__name__)


class Engine(Protocol):
    """What a pool needs from an engine (engine.async_engine.AsyncLLMEngine, or a test fake)."""

    tokenizer: Any
    max_model_len: int

    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        urgency: Urgency = DEFAULT_URGENCY,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's output deltas; closing the stream aborts the request."""

    async def embed(
        self, prompt_token_ids: list[int], request_id: str, urgency: Urgency = DEFAULT_URGENCY
    ) -> RequestOutput:
        """The prompt's pooled, normalized hidden state (`embedding`), computed as a
        prefill-only sequence in the engine's batch."""

    def abort(self, request_id: str) -> None:
        """Free everything the request holds; unknown ids are ignored."""

    def stats(self) -> EngineStats:
        """A snapshot of the engine's load and counters."""

    def is_alive(self) -> bool:
        """False once the step loop has died or stalled."""


@dataclass(frozen=True)
class NewSequence:
    """One sequence to generate: a prompt already tokenized and checked by the ingress."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    tpot_target_s: float | None = None
    """Its tier's time per output token, when the pool is to keep it (None: no target)."""
    stream: bool = True
    """Whether the caller reads deltas as they come. When not (a non-streamed answer, a
    batch line), the pool sends the first delta (its time is the TTFT), then the rest as
    one with the last, instead of a message per step per sequence that nobody reads.
    The ingress then sees such a sequence's progress only at its first token and end."""


@dataclass(frozen=True)
class NewEmbedding:
    """One input to embed: tokenized and checked by the ingress, at its tier's priority."""

    request_id: str
    prompt_token_ids: list[int]
    priority: int
    pooling: PoolingParams = MEAN_POOLING
    """How its states become one vector: /v1/embeddings serves the mean; the semantic cache
    asks for its own (serving/cache/question_embedding.py)."""


@dataclass(frozen=True)
class ReplicaStats:
    """One replica's engine stats, tagged with the replica so the ingress can count live ones."""

    replica_id: str
    engine: EngineStats | None
    """None while the replica has no engine yet (see `unavailable`)."""
    max_model_len: int
    """The replica's context length: the ingress learns it with the load."""
    unavailable: str | None = None
    """Why the replica serves nothing yet (its model is still being made), or None."""
    grammar_mask_s: float = 0.0
    """What one constrained row's grammar mask adds to a step here, measured when the
    engine came up (engine/grammar.py `mask_cost_s`; 0 for a test fake)."""
    student: ServedStudent | None = None
    """The distilled student the engine runs and the router beside it (None: no student),
    so the ingress routes by the router fitted to it."""


EngineFactory = Callable[[EngineConfig], Engine]
"""An engine class, or anything that builds an engine from its config."""


async def _first_and_last(stream: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """The deltas up to the first token as they come, the rest joined into the last."""
    held: RequestOutput | None = None
    async for output in stream:
        first_token = output.num_output_tokens == len(output.new_token_ids)
        if held is None and (first_token or output.finished):
            yield output
        else:
            held = output if held is None else held.then(output)
            if output.finished:
                yield held


def _default_engine_cls() -> EngineFactory:
    # Imported here: it loads torch and the model code, which the ingress never needs.
    from engine.async_engine import AsyncLLMEngine

    return AsyncLLMEngine


@serve.deployment
class Pool:
    """One engine per replica: streams generations, reports load, fails health when wedged.

    The replica owns its process, so it sets the process-wide torch thread count
    from the engine config before building the engine (an engine with
    `separate_process` sets its child's the same way).
    """

    def __init__(
        self,
        config: EngineConfig,
        engine_cls: EngineFactory | None = None,
        distill_if_missing: bool = False,
    ) -> None:
        if engine_cls is None:
            from engine.process import configure_process  # torch: only real replicas need it

            configure_process(config)
        self._max_num_seqs = config.max_num_seqs
        self._engine: Engine | None = None
        self._student: ServedStudent | None = None
        self._student_wait_distills: bool | None = None
        """None unless the replica waits for a student; then whether it distils one meanwhile."""
        self._cache_dir = config.cache_dir
        self._load_error: BaseException | None = None
        self._measures_masks = engine_cls is None
        self._grammar_mask_s = 0.0
        factory = engine_cls or _default_engine_cls()
        try:
            self._start(config, factory)
        except StudentMissing:
            self._student_wait_distills = distill_if_missing
            waiter = threading.Thread(
                target=self._load_student,
                args=(config, factory, distill_if_missing),
                name="student-wait",
                daemon=True,
            )
            waiter.start()

    def _load_student(self, config: EngineConfig, factory: EngineFactory, distill: bool) -> None:
        """Wait for the student to be published (distilling it when asked), then serve it;
        a failure surfaces in check_health, so Serve replaces the replica."""
        try:
            wait_for_student(config.cache_dir, distill)
            self._start(config, factory)
        except Exception as error:
            log.exception("loading the distilled student failed")
            self._load_error = error
            return
        self._student_wait_distills = None
        log.warning("the distilled student is loaded: this pool now serves")

    def _start(self, config: EngineConfig, factory: EngineFactory) -> None:
        """Build the engine and serve it; a student is pinned to its folder first, so the
        replica reports the student it loaded (serving/pools/served_student.py)."""
        config, self._student = pin_student(config)
        self._serve(factory(config))

    def _serve(self, engine: Engine) -> None:
        """Start serving `engine`, its grammar mask cost measured first (real engines only:
        a fake's tokenizer is nothing xgrammar reads)."""
        if self._measures_masks:
            from engine.grammar import mask_cost_s  # torch: only real replicas need it

            self._grammar_mask_s = mask_cost_s(engine.tokenizer)
        self._engine = engine

    async def generate(self, request: NewSequence) -> AsyncIterator[RequestOutput]:
        """Stream the engine's deltas; leaving early (cancel, disconnect) aborts in the engine.

        `aclosing` closes the engine's generator at once when Serve cancels
        this one, which is what frees the request's KV blocks.
        """
        stream = self._ready().generate(
            request.prompt_token_ids,
            request.params,
            request.request_id,
            Urgency(request.priority, request.tpot_target_s),
        )
        # Engines implement `generate` as an async generator; the engine annotates an iterator.
        async with aclosing(cast(AsyncGenerator[RequestOutput, None], stream)):
            deltas = stream if request.stream else _first_and_last(stream)
            async for output in deltas:
                yield output

    async def embed(self, request: NewEmbedding) -> RequestOutput:
        """One input's embedding through the engine's batch (engine/pooling.py); the
        engine aborts it if this call is cancelled."""
        urgency = Urgency(request.priority, None)
        engine = self._ready()
        return await engine.embed(
            request.prompt_token_ids, request.request_id, urgency, request.pooling
        )

    def tokenizer(self) -> Any:
        """The tokenizer the ingress counts and encodes prompts with."""
        return self._ready().tokenizer

    def stats(self) -> ReplicaStats:
        """This replica's engine stats, for the ingress's pool monitor."""
        replica_id = serve.get_replica_context().replica_id.unique_id
        if self._engine is None:
            return ReplicaStats(replica_id, None, 0, self._unavailable())
        return ReplicaStats(
            replica_id,
            self._engine.stats(),
            self._engine.max_model_len,
            grammar_mask_s=self._grammar_mask_s,
            student=self._student,
        )

    def check_health(self) -> None:
        """Serve replaces the replica when this raises: a dead step loop would hang every
        stream, and a failed student load would leave the pool waiting forever."""
        if self._load_error is not None:
            raise RuntimeError("loading the distilled student failed") from self._load_error
        if self._engine is None:
            return
        if not self._engine.is_alive():
            raise RuntimeError("engine step loop is not running")

    def _ready(self) -> Engine:
        """The engine; an error naming why when the replica has none yet (the ingress
        routes nothing here until it reports one, so only a race ends here)."""
        if self._engine is None:
            raise RuntimeError(f"this pool is unavailable: {self._unavailable()}")
        return self._engine

    def _unavailable(self) -> str | None:
        """Why the replica cannot serve yet (None once it can), with the distillation's
        progress when it runs one."""
        if self._student_wait_distills is None:
            return None
        return waiting_reason(self._cache_dir, self._student_wait_distills)

    def record_routing_stats(self) -> dict[str, float]:
        """Read by the pool's request router (serving/pools/replica_choice.py) to rank replicas.

        The engine load plus `max_num_seqs`, so the router can tell free batch
        slots from a queue without knowing the pool's config.
        """
        return {**self._load(), "max_num_seqs": self._max_num_seqs}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Custom autoscaling metrics: engine queue and KV pressure, beyond ongoing requests."""
        return self._load()

    def _load(self) -> dict[str, float]:
        if self._engine is None:
            return {"num_waiting": 0, "num_running": 0, "kv_cache_usage": 0.0}
        stats = self._engine.stats()
        return {
            "num_waiting": stats.num_waiting,
            "num_running": stats.num_running,
            "kv_cache_usage": stats.kv_cache_usage,
        }
