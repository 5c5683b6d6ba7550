"""The engine's step loop in a child process of its own (EngineConfig.separate_process).

Why: in a Serve replica the engine thread shares the GIL with Ray's threads
and the replica's event loop, which wake on every step to stream its deltas.
Each time a torch kernel returns, the step waits for whichever of them holds
the GIL. Measured on 4 chat streams on 2 cores, with the engine thread pinned
to a core of its own: steps ran 9% longer than their CPU time. A child
process has a GIL of its own; the parent keeps only the streams.

The pipe carries `add` / `abort` messages down, and up: `ready` (tokenizer,
limits, stats) or `failed` (the start-up error, re-raised in the parent),
then `step` messages: each what the loop published while the one before was being
sent (outputs in order, the latest stats), sent by a thread of the child's own so
that a parent slow to read never holds up a step (`Outbox`). The
running step's start time sits in shared memory for the parent's health
check. The child exits when its parent's end of the pipe closes; the parent
fails every live stream when the child's end does.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from engine.config import EngineConfig
from engine.engine_loop import EngineLoop, EngineRequestError, Publish, is_stalled
from engine.messages import Delivery, EngineReady, InboxMessage, StartFailed, StepDone
from engine.outputs import EngineStats
from engine.prompt_limits import PromptLimits

log = logging.getLogger(__name__)

_interpreter_exiting = False
"""Set by an exit hook registered after multiprocessing's, so it runs before it: a child
that multiprocessing then ends (SIGTERM, reaped by whichever thread joins first, so its
exit code may read as None here) went with the interpreter, not by failing."""


def _mark_interpreter_exiting() -> None:
    global _interpreter_exiting
    _interpreter_exiting = True


atexit.register(_mark_interpreter_exiting)


class EngineProcess:
    """The loop in a spawned child process; this side sends messages and reads its steps."""

    def __init__(
        self,
        config: EngineConfig,
        publish: Publish,
        lost: Callable[[BaseException], None],
    ) -> None:
        """Start the child and wait until its engine is built; its start-up error is
        raised here (a missing student, a bad model path)."""
        context = multiprocessing.get_context("spawn")  # fork would copy Ray's threads
        self._conn, child_conn = context.Pipe()
        self._step_started = context.Value(ctypes.c_double, 0.0, lock=False)
        self._process = context.Process(
            target=_child_main,
            args=(config, child_conn, self._step_started),
            name="engine-core",
            daemon=True,
        )
        self._process.start()
        child_conn.close()
        self.tokenizer, self.limits, stats = self._await_ready()
        publish([], stats)
        self._publish = publish
        self._lost = lost
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self._reader.start()

    def send(self, message: InboxMessage) -> None:
        """Forward an inbox message to the child (from any thread); to a dead child it is
        dropped: the reader thread ends every live stream once the pipe closes."""
        with self._send_lock:
            try:
                self._conn.send(message)
            except OSError:
                log.warning("engine process gone: %s dropped", message)

    def is_alive(self, stall_timeout_s: float) -> bool:
        """The child runs and no step of it is stuck."""
        return self._process.is_alive() and not is_stalled(self._step_started, stall_timeout_s)

    def _await_ready(self) -> tuple[Any, PromptLimits, EngineStats]:
        try:
            message: EngineReady | StartFailed = self._conn.recv()
        except EOFError:
            self._process.join()
            raise RuntimeError(
                f"the engine process exited during start-up (code {self._process.exitcode})"
            ) from None
        if isinstance(message, StartFailed):
            self._process.join()
            raise message.error
        return message.tokenizer, message.limits, message.stats

    def _read(self) -> None:
        """Deliver the child's steps until its end of the pipe closes."""
        try:
            while True:
                step: StepDone = self._conn.recv()
                self._publish(step.items, step.stats)
        except (EOFError, OSError):
            self._process.join(timeout=5)
            code = self._process.exitcode
            # At interpreter exit multiprocessing ends daemons with SIGTERM, or this side's
            # end of the pipe is closed first: neither is a failure.
            ended_at_exit = _interpreter_exiting or code == -signal.SIGTERM or self._conn.closed
            log.log(logging.INFO if ended_at_exit else logging.ERROR,
                    "engine process exited (code %s): its streams end", code)  # fmt: skip
            self._lost(EngineRequestError("the engine process exited"))


def _child_main(config: EngineConfig, conn: Connection, step_started: ctypes.c_double) -> None:
    """The child: own the process settings (its pool's CPU priority too: the parent, a
    Serve replica, keeps Ray's), build the engine, serve the loop."""
    from engine.engine import LLMEngine  # torch and the model load here, not in the parent
    from engine.process import apply_cpu_priority, configure_process

    apply_cpu_priority(config.cpu_priority)
    configure_process(config)
    try:
        engine = LLMEngine(config)
    except BaseException as exc:  # noqa: BLE001 - the parent re-raises it
        conn.send(StartFailed(exc))
        return
    conn.send(EngineReady(engine.tokenizer, engine.limits, engine.stats()))
    outbox = Outbox(conn)
    loop = EngineLoop(engine, outbox.publish, step_started)
    threading.Thread(target=_forward_inbox, args=(conn, loop), daemon=True).start()
    loop.run()
    outbox.flush()  # the dead loop's last refusals reach the parent before the child ends


class Outbox:
    """What the loop publishes, sent up the pipe by a thread of its own. Sent by the loop
    itself, a parent slow to read (a Serve replica at Ray's niceness, starved by the
    engines) held the loop in `send` for a fifth of its time under bench_sla's overload,
    and every step of the pool ran that much longer. Whatever is published while a send
    is under way goes up together, as one message: a parent that fell behind catches up
    in fewer reads."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._items: Delivery = []
        self._stats: EngineStats | None = None
        """The latest stats, until sent; None: nothing waits to be sent."""
        self._sending = False
        self._changed = threading.Condition()
        threading.Thread(target=self._send_forever, name="engine-outbox", daemon=True).start()

    def publish(self, items: Delivery, stats: EngineStats) -> None:
        """Queue a turn's outputs and stats for the parent; never waits for it."""
        with self._changed:
            self._items.extend(items)
            self._stats = stats
            self._changed.notify_all()

    def flush(self) -> None:
        """Wait until everything published has been sent (or the parent is gone)."""
        with self._changed:
            self._changed.wait_for(lambda: self._stats is None and not self._sending)

    def _send_forever(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._stats is not None)
                message = StepDone(self._items, self._stats)
                self._items, self._stats, self._sending = [], None, True
            with contextlib.suppress(OSError):  # the parent is gone: _forward_inbox ends us
                self._conn.send(message)
            with self._changed:
                self._sending = False
                self._changed.notify_all()


def _forward_inbox(conn: Connection, loop: EngineLoop) -> None:
    """Parent's messages into the loop's inbox; the parent gone, the child ends at once."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            os._exit(0)
        loop.send(message)
