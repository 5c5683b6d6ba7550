"""asyncio front of the engine: `generate` streams deltas, a daemon thread runs `step()`.

torch releases the GIL inside its kernels, so the event loop stays responsive
while a step runs. Requests and aborts reach the loop thread through a
thread-safe inbox; outputs come back through each stream's asyncio.Queue on
the caller's event loop.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncGenerator

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.outputs import EngineStats, RequestOutput
from engine.sampling_params import SamplingParams


class AsyncLLMEngine:
    """`generate` / `abort` / `stats` over an LLMEngine stepped in a daemon thread."""

    def __init__(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stats = self.engine.stats()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run_loop, name="engine-loop", daemon=True)
        self._thread.start()

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream the request's deltas; stopping iteration early aborts it."""
        self.engine.validate(prompt_token_ids, params)
        if self._error is not None:
            raise RuntimeError("engine loop is dead") from self._error
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self._send(("add", request_id, prompt_token_ids, params, priority))
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def stats(self) -> EngineStats:
        """The snapshot taken after the latest step (safe to read from any thread)."""
        return self._stats

    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    def _send(self, message: tuple) -> None:
        self._inbox.put(message)
        self._wake.set()

    def _run_loop(self) -> None:
        try:
            while True:
                self._drain_inbox()
                if not self.engine.has_unfinished():
                    self._wake.wait()
                    self._wake.clear()
                    continue
                for output in self.engine.step():
                    self._deliver(output.request_id, output)
                self._stats = self.engine.stats()
        except BaseException as exc:  # surfaced to every waiting stream
            self._error = exc
            for request_id in list(self._streams):
                self._deliver(request_id, RuntimeError(f"engine loop died: {exc!r}"))

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
        self, request_id: str, prompt: list[int], params: SamplingParams, priority: int
    ) -> None:
        try:
            self.engine.add_request(request_id, prompt, params, priority)
        except ValueError as exc:
            self._deliver(request_id, exc)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)
