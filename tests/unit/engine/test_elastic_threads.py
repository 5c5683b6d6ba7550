"""Threads that follow the node's demand (engine.elastic_threads): the marks engines leave,
the thread count an elastic engine picks from them, and output that does not depend on it."""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from engine.config import EngineConfig
from engine.elastic_threads import (
    DEMAND_DIR,
    FORGET_AFTER_S,
    STALE_S,
    ElasticThreads,
    NodeDemand,
)
from engine.engine import LLMEngine
from engine.engine_loop import EngineLoop
from engine.messages import AddRequest
from engine.request import DEFAULT_URGENCY
from engine.sampling_params import SamplingParams


@pytest.fixture
def torch_threads() -> Iterator[None]:
    """Whatever a test sets, the process's thread count is restored after it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_an_engine_sees_the_others_marks_not_its_own(tmp_path) -> None:
    interactive, offline = NodeDemand(tmp_path), NodeDemand(tmp_path)
    assert not interactive.others_busy()

    offline.mark_busy()
    assert interactive.others_busy()
    assert not offline.others_busy()

    offline.close()
    assert not interactive.others_busy()


def test_a_mark_older_than_stale_is_idle(tmp_path) -> None:
    interactive, offline = NodeDemand(tmp_path), NodeDemand(tmp_path)
    offline.mark_busy()
    (mark,) = [p for p in tmp_path.iterdir() if p.name.endswith(str(id(offline)))]
    old_s = time.time() - STALE_S - 0.1
    os.utime(mark, (old_s, old_s))

    assert not interactive.others_busy()


def test_marks_left_by_engines_long_gone_are_deleted(tmp_path) -> None:
    gone = tmp_path / "12345-1"
    gone.touch()
    old_s = time.time() - FORGET_AFTER_S - 1
    os.utime(gone, (old_s, old_s))
    recent = tmp_path / "12345-2"
    recent.touch()

    NodeDemand(tmp_path)

    assert not gone.exists() and recent.exists()


def test_an_elastic_engine_takes_its_alone_threads_only_while_the_others_idle(
    tmp_path, torch_threads
) -> None:
    own, other = NodeDemand(tmp_path), NodeDemand(tmp_path)
    threads = ElasticThreads(shared=1, alone=2, demand=own)

    threads.before_step()
    assert torch.get_num_threads() == 2

    other.mark_busy()
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


def test_the_engine_loop_marks_its_engine_busy_while_it_steps(make_engine) -> None:
    finished: list[str] = []
    loop = EngineLoop(
        make_engine(max_num_seqs=4),
        lambda items, stats: finished.extend(i for i, out in items if getattr(out, "finished", 0)),
        ctypes.c_double(0.0),
    )
    started_s = time.time()
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    loop.send(AddRequest("marked", [1000] * 8, params, DEFAULT_URGENCY))

    while not finished:
        loop._loop_once()  # one inbox drain and step, as `run` repeats them

    own_marks = [p for p in DEMAND_DIR.iterdir() if p.name.startswith(f"{os.getpid()}-")]
    assert any(p.stat().st_mtime >= started_s - 1 for p in own_marks)
    assert loop.threads is None  # the test engine's config asks for no elastic threads


def test_an_engine_configured_alone_threads_steps_elastic(make_engine) -> None:
    engine = make_engine(max_num_seqs=4, num_threads=1, num_threads_alone=2)

    loop = EngineLoop(engine, lambda items, stats: None, ctypes.c_double(0.0))

    assert loop.threads is not None
    assert (loop.threads.shared, loop.threads.alone) == (1, 2)
