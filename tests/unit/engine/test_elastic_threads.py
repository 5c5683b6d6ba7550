"""Threads that follow the node's demand (engine.elastic_threads): the marks engines leave,
the thread count an elastic engine picks from them, and output that does not depend on it."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from bench.paths import REPO_ROOT
from engine.config import EngineConfig
from engine.elastic_threads import DEMAND_DIR, ElasticThreads, NodeDemand
from engine.engine import LLMEngine
from engine.engine_loop import EngineLoop
from engine.messages import AbortRequest, AddRequest
from engine.request import DEFAULT_URGENCY
from engine.sampling_params import SamplingParams


@pytest.fixture
def torch_threads() -> Iterator[None]:
    """Whatever a test sets, the process's thread count is restored after it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_an_engine_sees_the_others_declarations_not_its_own(tmp_path) -> None:
    interactive, offline = NodeDemand(tmp_path), NodeDemand(tmp_path)
    assert not interactive.others_busy()

    offline.set_busy(True)
    assert interactive.others_busy()
    assert not offline.others_busy()

    offline.set_busy(False)
    assert not interactive.others_busy()
    offline.set_busy(True)
    offline.close()
    assert not interactive.others_busy()


def test_a_declaration_stands_however_long_the_step_takes(tmp_path) -> None:
    """The offline pool's step can take a second: its engine stays busy through it."""
    interactive, offline = NodeDemand(tmp_path), NodeDemand(tmp_path)
    offline.set_busy(True)
    (declared,) = tmp_path.iterdir()
    an_hour_ago_s = time.time() - 3600
    os.utime(declared, (an_hour_ago_s, an_hour_ago_s))

    assert interactive.others_busy()


def test_a_declaration_nobody_holds_is_not_busy_and_is_deleted(tmp_path) -> None:
    """Named after a live process (as a killed engine's file is once its id is reused),
    but unlocked: stale."""
    declared = tmp_path / f"{os.getppid()}-1-0"
    declared.touch()

    assert not NodeDemand(tmp_path).others_busy()
    assert not declared.exists()


def test_a_killed_engines_declaration_stops_counting(tmp_path) -> None:
    engine = subprocess.Popen(
        [sys.executable, "-c", DECLARE_AND_WAIT, str(tmp_path)],
        stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT,
    )  # fmt: skip
    try:
        assert engine.stdout is not None and engine.stdout.readline() == "declared\n"
        assert NodeDemand(tmp_path).others_busy()
    finally:
        engine.kill()
        engine.wait()
    assert not NodeDemand(tmp_path).others_busy()
    assert not list(tmp_path.iterdir())


DECLARE_AND_WAIT = """
import sys, time
from pathlib import Path
from engine.elastic_threads import NodeDemand
NodeDemand(Path(sys.argv[1])).set_busy(True)
print("declared", flush=True)
time.sleep(600)
"""
"""An engine's declaration in a process of its own, which the test kills (SIGKILL: nothing
of the engine's own runs to withdraw it)."""


def test_an_elastic_engine_takes_its_alone_threads_only_while_the_others_idle(
    tmp_path, torch_threads
) -> None:
    own, other = NodeDemand(tmp_path), NodeDemand(tmp_path)
    threads = ElasticThreads(shared=1, alone=2, demand=own)

    threads.before_step()
    assert torch.get_num_threads() == 2

    other.set_busy(True)
    threads.before_step()
    assert torch.get_num_threads() == 1


def test_alone_threads_need_a_shared_count_no_larger() -> None:
    with pytest.raises(ValueError, match="num_threads_alone"):
        EngineConfig(num_threads_alone=2)
    with pytest.raises(ValueError, match="must be >= it"):
        EngineConfig(num_threads=2, num_threads_alone=1)
    assert EngineConfig(num_threads=1, num_threads_alone=2).num_threads_alone == 2


def _run_seeded(engine: LLMEngine, threads_at_step: Callable[[int], int]) -> dict[str, list]:
    """Three seeded sampled requests, the third arriving while the others decode (its
    prefill shares their steps); each step at `threads_at_step(step)` threads. Their
    tokens and logprobs."""
    prompts = [[1000 + i] * (20 + 7 * i) for i in range(3)]
    outputs: dict[str, list] = {}
    for step in range(10_000):
        if step in (0, 3):
            for i in (0, 1) if step == 0 else (2,):
                params = SamplingParams(max_tokens=24, temperature=0.8, seed=i, logprobs=2)
                engine.add_request(f"threads-{id(threads_at_step)}-{i}", prompts[i], params)
        if not engine.has_unfinished():
            return outputs
        torch.set_num_threads(threads_at_step(step))
        for output in engine.step():
            key = output.request_id.rsplit("-", 1)[1]
            outputs.setdefault(key, []).extend(
                zip(output.new_token_ids, output.new_logprobs, strict=True)
            )
    raise AssertionError("the requests never finished")


def test_a_seeded_request_is_the_same_bits_whatever_threads_its_steps_ran_on(
    make_engine, torch_threads
) -> None:
    engine = make_engine(max_num_seqs=4)

    one_thread = _run_seeded(engine, lambda step: 1)
    changing = _run_seeded(engine, lambda step: 1 + step % 2)

    assert sorted(one_thread) == ["0", "1", "2"]
    assert changing == one_thread


def test_the_engine_loop_declares_its_engine_busy_while_it_has_work(make_engine) -> None:
    finished: list[str] = []
    loop = EngineLoop(
        make_engine(max_num_seqs=4),
        lambda items, stats: finished.extend(i for i, out in items if getattr(out, "finished", 0)),
        ctypes.c_double(0.0),
    )
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    loop.send(AddRequest("declared", [1000] * 8, params, DEFAULT_URGENCY))

    busy_after_steps = []
    while not finished:
        loop._loop_once()  # one inbox drain and step, as `run` repeats them
        busy_after_steps.append(bool(_declared_by_this_process()))
    loop.send(AbortRequest("none"))  # wakes the loop, idle now
    loop._loop_once()

    assert busy_after_steps and all(busy_after_steps)
    assert not _declared_by_this_process()
    assert loop.threads is None  # the test engine's config asks for no elastic threads


def _declared_by_this_process() -> list[str]:
    return [p.name for p in DEMAND_DIR.iterdir() if p.name.startswith(f"{os.getpid()}-")]


def test_an_engine_configured_alone_threads_steps_elastic(make_engine) -> None:
    engine = make_engine(max_num_seqs=4, num_threads=1, num_threads_alone=2)

    loop = EngineLoop(engine, lambda items, stats: None, ctypes.c_double(0.0))

    assert loop.threads is not None
    assert (loop.threads.shared, loop.threads.alone) == (1, 2)
