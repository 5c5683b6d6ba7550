"""asyncio front of the engine: `generate` streams deltas; a core runs the step loop.

The core is `engine.engine_loop.EngineThread` (a daemon thread of this
process) or, with `EngineConfig.separate_process`,
`engine.engine_process.EngineProcess` (a child process with a GIL of its
own). Either way requests and aborts go to the core as messages, and each
step's outputs come back through each stream's asyncio.Queue on the caller's
event loop.

A request that fails in the engine ends its own stream with
`EngineRequestError`; a step that runs past `EngineConfig.stall_timeout_s`, a
dead loop or a dead child makes `is_alive()` false, so the pool's health
check can have the replica replaced.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import AsyncGenerator

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.engine_loop import EngineRequestError, EngineThread
from engine.engine_process import EngineProcess
from engine.messages import AbortRequest, AddRequest, Delivery
from engine.outputs import EngineStats, RequestOutput
from engine.request import DEFAULT_URGENCY, Urgency
from engine.sampling_params import MEAN_POOLING, PoolingParams, SamplingParams

__all__ = ["EMBEDDING_PARAMS", "AsyncLLMEngine", "EngineRequestError"]

EMBEDDING_PARAMS = SamplingParams(max_tokens=1, temperature=0)
"""What an embedding request is checked against (its prompt must fit the context like a
one-token generation's); nothing is ever sampled with them."""


class AsyncLLMEngine:
    """`generate` / `abort` / `stats` over an LLMEngine stepped by a thread or a process."""

    def __init__(self, config: EngineConfig) -> None:
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stall_timeout_s = config.stall_timeout_s
        self._stats: EngineStats  # set by the core's first publish, before it returns
        self.core: EngineThread | EngineProcess = (
            EngineProcess(config, self._publish, self._fail_streams)
            if config.separate_process
            else EngineThread(LLMEngine(config), self._publish)
        )
        self.tokenizer = self.core.tokenizer
        self.limits = self.core.limits
        self.max_model_len = self.limits.max_model_len

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        urgency: Urgency = DEFAULT_URGENCY,
        pooling: PoolingParams | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream the request's deltas; stopping iteration early aborts it. With `pooling`
        the request is an embedding: one output, its `embedding` set.

        Raises ValueError for a request the engine refuses, EngineRequestError when
        the request fails inside the engine.
        """
        self.limits.check(prompt_token_ids, params)
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        # Checked after registering: a core lost from here on ends this stream too.
        if not self.core.is_alive(stall_timeout_s=math.inf):  # a slow step still serves
            del self._streams[request_id]
            raise RuntimeError("the engine loop is dead")
        sent_s = time.time()
        self.core.send(AddRequest(request_id, prompt_token_ids, params, urgency, pooling))
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if item.finish_reason == "error":
                    raise EngineRequestError(item.error or "request failed in the engine")
                yield _stamped(item, sent_s)
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    async def embed(
        self,
        prompt_token_ids: list[int],
        request_id: str,
        urgency: Urgency = DEFAULT_URGENCY,
        pooling: PoolingParams = MEAN_POOLING,
    ) -> RequestOutput:
        """The prompt's pooled hidden state, batched with everything else the engine runs
        (a prefill-only sequence); the output's `embedding` and `num_prompt_tokens`."""
        async for output in self.generate(
            prompt_token_ids, EMBEDDING_PARAMS, request_id, urgency, pooling
        ):
            if output.finished:
                return output
        raise EngineRequestError("the embedding request ended without a result")

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks (a no-op once it has finished)."""
        self.core.send(AbortRequest(request_id))

    def stats(self) -> EngineStats:
        """The snapshot taken after the latest step or inbox message (safe to read from
        any thread)."""
        return self._stats

    def is_alive(self) -> bool:
        """The core's loop runs and no step has been stuck past the stall timeout."""
        return self.core.is_alive(self._stall_timeout_s)

    def _publish(self, items: Delivery, stats: EngineStats) -> None:
        """What the core's loop publishes: its stats, then the items for the streams."""
        self._stats = stats  # before delivering: a finished client sees it
        if items:
            self._deliver_all(items)

    def _fail_streams(self, error: BaseException) -> None:
        """End every live stream with `error` (the core is gone)."""
        self._deliver_all([(request_id, error) for request_id in list(self._streams)])

    def _deliver_all(self, items: Delivery) -> None:
        """Hand each item to its stream: one wake-up per event loop, not one per request
        (a step of 64 sequences would otherwise wake the caller's loop 64 times)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        for request_id, item in items:
            target = self._streams.get(request_id)
            if target is not None:
                loop, stream = target
                by_loop.setdefault(loop, []).append((stream, item))
        for loop, puts in by_loop.items():
            loop.call_soon_threadsafe(_put_each, puts)


def _put_each(puts: list[tuple[asyncio.Queue, object]]) -> None:
    for stream, item in puts:
        stream.put_nowait(item)


def _stamped(output: RequestOutput, sent_s: float) -> RequestOutput:
    """The output with this front's instants in its first-token times (when it has them)."""
    times = output.first_token_times
    if times is None:
        return output
    times = times._replace(sent_s=sent_s, received_s=time.time())
    return dataclasses.replace(output, first_token_times=times)
