"""The step loop behind every async front, and the core that runs it in a thread.

`EngineLoop` owns an LLMEngine: it takes requests and aborts from a
thread-safe inbox, steps while work is live, and publishes each step's
outputs with a fresh stats snapshot. Where it runs is the core's choice:
`EngineThread` here (a daemon thread of the caller's process),
`engine.engine_process.EngineProcess` in a child process of its own.

The loop never dies silently: a request that fails in the engine ends its own
stream with an error output; an unexpected error in the loop itself fails
every live request with `EngineRequestError` and the loop goes on; only when
even aborting fails, or a tensor-parallel worker rank is lost, is the engine dead
(`error` is set and `run` returns).
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
import time
from collections.abc import Callable

from engine.elastic_threads import ElasticThreads, NodeDemand
from engine.engine import LLMEngine
from engine.messages import AddRequest, Delivery, InboxMessage
from engine.outputs import EngineStats
from engine.parallel.errors import RankLost
from engine.prompt_limits import PromptLimits

log = logging.getLogger(__name__)

Publish = Callable[[Delivery, EngineStats], None]
"""Where a core hands what its loop produced: the items, and the stats after them (the
async front keeps the stats and wakes the streams)."""


class EngineRequestError(RuntimeError):
    """One request failed inside the engine (its sampling, its output, or its step)."""


def is_stalled(step_started: ctypes.c_double, timeout_s: float) -> bool:
    """A step has been running past `timeout_s` (0.0 in `step_started`: none runs)."""
    started = step_started.value
    return started > 0.0 and time.monotonic() - started > timeout_s


class EngineLoop:
    """Inbox in, `publish(items, stats)` out, one `engine.step()` at a time."""

    def __init__(self, engine: LLMEngine, publish: Publish, step_started: ctypes.c_double) -> None:
        self.engine = engine
        self.error: BaseException | None = None
        self._publish = publish
        self._step_started = step_started
        """When the running step began (time.monotonic), 0.0 between steps: a c_double so
        a process core can place it in shared memory for its parent's health check."""
        self._inbox: queue.SimpleQueue[InboxMessage] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._demand = NodeDemand()
        self.threads = _elastic_threads(engine, self._demand)
        """The step's thread count by the node's demand; None where the config fixes it."""

    def send(self, message: InboxMessage) -> None:
        """Queue a message (from any thread); on a dead loop, refuse it at once."""
        self._inbox.put(message)
        self._wake.set()
        if self.error is not None:  # the loop may have made its last pass before this put
            self._refuse_inbox()

    def run(self) -> None:
        """Serve until the engine is beyond repair, then refuse whatever still waits."""
        while self.error is None:
            try:
                self._loop_once()
            except Exception as exc:  # noqa: BLE001 - fail the live requests, keep serving
                log.exception("engine loop error; failing every live request")
                self._fail_all(exc)
        self._demand.close()
        self._refuse_inbox()

    def _refuse_inbox(self) -> None:
        """Answer each request still in the inbox of a dead loop with the loop's error."""
        error = EngineRequestError(f"the engine is dead: {self.error!r}")
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(message, AddRequest):
                self._publish([(message.request_id, error)], self.engine.stats())

    def _loop_once(self) -> None:
        self._drain_inbox()
        if not self.engine.has_unfinished():
            self._demand.set_busy(False)
            self._wake.wait()
            self._wake.clear()
            return
        self._demand.set_busy(True)
        if self.threads is not None:
            self.threads.before_step()
        self._step_started.value = time.monotonic()
        outputs = self.engine.step()
        self._step_started.value = 0.0
        self._publish([(output.request_id, output) for output in outputs], self.engine.stats())

    def _fail_all(self, exc: Exception) -> None:
        """Abort every live request with an error; if even that fails, or a tensor-parallel
        rank is lost, the engine is dead."""
        self._step_started.value = 0.0
        live = list(self.engine.requests)
        if isinstance(exc, RankLost):  # no step can run without the lost rank's slice
            self.error = exc
        try:
            for request_id in live:
                self.engine.abort_request(request_id)
        except Exception as abort_exc:  # noqa: BLE001 - state is beyond repair
            self.error = abort_exc
        error = EngineRequestError(f"engine loop error: {exc!r}")
        self._publish([(request_id, error) for request_id in live], self.engine.stats())

    def _drain_inbox(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._publish(self._handle(message), self.engine.stats())

    def _handle(self, message: InboxMessage) -> Delivery:
        """Apply one inbox message; what it ends (a refused request, an aborted stream)."""
        if isinstance(message, AddRequest):
            try:  # the front checked it against the engine's limits before sending
                self.engine.enqueue(
                    message.request_id, message.prompt, message.params, message.urgency,
                    message.pooling,
                )  # fmt: skip
            except ValueError as exc:
                return [(message.request_id, exc)]
            return []
        aborted = self.engine.abort_request(message.request_id)
        return [] if aborted is None else [(aborted.request_id, aborted)]


def _elastic_threads(engine: LLMEngine, demand: NodeDemand) -> ElasticThreads | None:
    """The engine's thread count by the node's demand, where its config asks for it."""
    config = engine.config
    if config.num_threads_alone is None or config.num_threads is None:
        return None
    return ElasticThreads(config.num_threads, config.num_threads_alone, demand)


class EngineThread:
    """The loop in a daemon thread of this process: torch releases the GIL inside its
    kernels, so the caller's event loop stays responsive while a step runs."""

    def __init__(self, engine: LLMEngine, publish: Publish) -> None:
        self.tokenizer = engine.tokenizer
        self.limits: PromptLimits = engine.limits
        publish([], engine.stats())
        self._step_started = ctypes.c_double(0.0)
        self.loop = EngineLoop(engine, publish, self._step_started)
        self._thread = threading.Thread(target=self.loop.run, name="engine-loop", daemon=True)
        self._thread.start()

    def send(self, message: InboxMessage) -> None:
        """Queue an inbox message for the loop."""
        self.loop.send(message)

    def is_alive(self, stall_timeout_s: float) -> bool:
        """The thread runs, the engine is not dead, and no step is stuck."""
        return (
            self._thread.is_alive()
            and self.loop.error is None
            and not is_stalled(self._step_started, stall_timeout_s)
        )
