"""The engine stepped in a child process: start-up errors, a dying child, a dying parent.

Streaming itself (greedy parity with the synchronous engine, aborts, bad input)
runs over both cores in test_engine_api.py.
"""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bench.paths import REPO_ROOT
from engine.async_engine import AsyncLLMEngine, EngineRequestError
from engine.config import EngineConfig
from engine.engine_loop import is_stalled
from engine.engine_process import EngineProcess, Outbox
from engine.outputs import EngineStats
from testing.engine_helpers import TEST_ENGINE_CONFIG, greedy

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
CONFIG = EngineConfig(**TEST_ENGINE_CONFIG, separate_process=True)


def exited(pid: int) -> bool:
    """The process is gone or a zombie (its new parent may never reap it here)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "State:\tZ" in status


def wait_until(condition, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_start_up_error_in_the_child_is_raised_in_the_caller():
    config = EngineConfig(model="/nonexistent/model", separate_process=True)
    with pytest.raises(ValueError, match="/nonexistent/model"):
        AsyncLLMEngine(config)


def test_a_dead_child_ends_live_streams_and_fails_health():
    engine = AsyncLLMEngine(CONFIG)
    assert isinstance(engine.core, EngineProcess)

    async def scenario() -> None:
        stream = engine.generate(PROMPT, greedy(200, ignore_eos=True), "doomed")
        await anext(stream)
        os.kill(engine.core._process.pid, signal.SIGKILL)
        with pytest.raises(EngineRequestError, match="engine process exited"):
            async for _ in stream:
                pass

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    assert not engine.is_alive()
    with pytest.raises(RuntimeError, match="dead"):
        asyncio.run(anext(engine.generate(PROMPT, greedy(2), "after")))


ENGINE_IN_A_SCRIPT = """
import logging, os, sys
sys.path[:0] = [sys.argv[1]]
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
from testing.engine_helpers import TEST_ENGINE_CONFIG
from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
config = EngineConfig(**TEST_ENGINE_CONFIG, separate_process=True, cpu_priority=sys.argv[2])
engine = AsyncLLMEngine(config)
print(engine.core._process.pid, flush=True)
"""
"""A script that starts an engine in its own process (at the CPU priority its third
argument names) and prints the child's pid; what follows it (if anything) decides how the
script ends."""


def run_engine_script(ending: str, cpu_priority: str = "inherit") -> subprocess.CompletedProcess:
    """Run ENGINE_IN_A_SCRIPT then `ending` in a fresh interpreter."""
    script = ENGINE_IN_A_SCRIPT + ending
    return subprocess.run(
        [sys.executable, "-c", script, str(REPO_ROOT), cpu_priority],
        capture_output=True, text=True, timeout=600,  # a backstop: a loaded CI machine is slow
    )  # fmt: skip


@pytest.mark.parametrize("cpu_priority", ["inherit", "urgent"])
def test_the_child_exits_when_its_parent_is_killed(cpu_priority: str):
    """Also when it leads a session of its own (`urgent`): a kill of the parent's process
    group would miss it, the closed pipe does not."""
    parent = run_engine_script("os.kill(os.getpid(), 9)\n", cpu_priority)
    assert parent.returncode == -signal.SIGKILL, parent.stderr
    child_pid = int(parent.stdout.split()[0])
    assert wait_until(lambda: exited(child_pid)), "the engine process outlived its parent"


def test_an_ordinary_exit_is_not_logged_as_the_engine_process_failing():
    run = run_engine_script("")
    assert run.returncode == 0 and run.stdout.split()[0].isdigit(), run.stderr
    assert "ERROR" not in run.stderr, run.stderr


def test_a_step_counts_as_stalled_only_while_it_runs_past_the_timeout():
    assert not is_stalled(ctypes.c_double(0.0), timeout_s=1.0)  # no step running
    assert not is_stalled(ctypes.c_double(time.monotonic()), timeout_s=1.0)
    assert is_stalled(ctypes.c_double(time.monotonic() - 5.0), timeout_s=1.0)


def test_the_outbox_never_waits_for_a_parent_that_does_not_read():
    """Published turns queue while the parent is busy elsewhere, then reach it in order,
    several to a message."""
    parent, child = multiprocessing.Pipe()
    outbox = Outbox(child)
    stats = EngineStats(0, 0, 0.0, 0, 0, 0, 0.0)
    turns = [[(f"r{i}", EngineRequestError("x" * 100_000))] for i in range(40)]
    publishing = threading.Thread(target=lambda: [outbox.publish(t, stats) for t in turns])
    publishing.start()
    publishing.join(timeout=10)
    assert not publishing.is_alive()  # 4 MB published with nobody reading: never blocked
    received: list[str] = []
    messages = 0
    while len(received) < len(turns):
        received += [request_id for request_id, _ in parent.recv().items]
        messages += 1
    assert received == [f"r{i}" for i in range(40)] and messages < len(turns)
    outbox.flush()
