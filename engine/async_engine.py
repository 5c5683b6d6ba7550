"""asyncio front of the engine: `generate` streams deltas, a daemon thread runs `step()`.

torch releases the GIL inside its kernels, so the event loop stays responsive
while a step runs. Requests and aborts reach the loop thread through a
thread-safe inbox; outputs come back through each stream's asyncio.Queue on
the caller's event loop.

The loop never dies silently: a request that fails in the engine ends its own
stream with `EngineRequestError`; an unexpected error in the loop itself fails
every live stream and the loop goes on; a step that runs past
`EngineConfig.stall_timeout_s` while work waits makes `is_alive()` false, so
the pool's health check can have the replica replaced.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.outputs import EngineStats, RequestOutput
from engine.request import DEFAULT_URGENCY, Urgency
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineRequestError(RuntimeError):
    """One request failed inside the engine (its sampling, its output, or its step)."""


class AsyncLLMEngine:
    """`generate` / `abort` / `stats` over an LLMEngine stepped in a daemon thread."""

    def __init__(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self._stall_timeout_s = config.stall_timeout_s
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stats = self.engine.stats()
        self._error: BaseException | None = None
        self._step_started_s: float | None = None
        self._thread = threading.Thread(target=self._run_loop, name="engine-loop", daemon=True)
        self._thread.start()

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        urgency: Urgency = DEFAULT_URGENCY,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream the request's deltas; stopping iteration early aborts it.

        Raises ValueError for a request the engine refuses, EngineRequestError when
        the request fails inside the engine.
        """
        self.engine.validate(prompt_token_ids, params)
        if self._error is not None:
            raise RuntimeError("engine loop is dead") from self._error
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self._send(("add", request_id, prompt_token_ids, params, urgency))
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if item.finish_reason == "error":
                    raise EngineRequestError(item.error or "request failed in the engine")
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks (a no-op once it has finished)."""
        self._send(("abort", request_id))

    def stats(self) -> EngineStats:
        """The snapshot taken after the latest step (safe to read from any thread)."""
        return self._stats

    def is_alive(self) -> bool:
        """The loop thread runs and no step has been stuck past the stall timeout."""
        started = self._step_started_s
        stalled = started is not None and time.monotonic() - started > self._stall_timeout_s
        return self._thread.is_alive() and self._error is None and not stalled

    def _send(self, message: tuple) -> None:
        self._inbox.put(message)
        self._wake.set()

    def _run_loop(self) -> None:
        while self._error is None:
            try:
                self._loop_once()
            except Exception as exc:  # noqa: BLE001 - fail the live requests, keep serving
                log.exception("engine loop error; failing every live request")
                self._fail_all(exc)

    def _loop_once(self) -> None:
        self._drain_inbox()
        if not self.engine.has_unfinished():
            self._wake.wait()
            self._wake.clear()
            return
        self._step_started_s = time.monotonic()
        outputs = self.engine.step()
        self._step_started_s = None
        self._stats = self.engine.stats()  # before delivering: a finished client sees it
        self._deliver_all([(output.request_id, output) for output in outputs])

    def _fail_all(self, exc: Exception) -> None:
        """Abort every live request with an error; if even that fails, the engine is dead."""
        self._step_started_s = None
        try:
            for request_id in list(self.engine.requests):
                self.engine.abort_request(request_id)
        except Exception as abort_exc:  # noqa: BLE001 - state is beyond repair
            self._error = abort_exc
        for request_id in list(self._streams):
            self._deliver(request_id, EngineRequestError(f"engine loop error: {exc!r}"))

    def _drain_inbox(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if message[0] == "add":
                self._add(*message[1:])
            elif (aborted := self.engine.abort_request(message[1])) is not None:
                self._deliver(aborted.request_id, aborted)  # ends a stream still being read
            self._stats = self.engine.stats()

    def _add(
        self, request_id: str, prompt: list[int], params: SamplingParams, urgency: Urgency
    ) -> None:
        try:
            self.engine.add_request(request_id, prompt, params, *urgency)
        except ValueError as exc:
            self._deliver(request_id, exc)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
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
