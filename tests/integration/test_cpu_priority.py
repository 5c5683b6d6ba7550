"""A pool's CPU priority, taken by its engine's child process (engine.process.apply_cpu_priority).

Each case runs in a process of its own, started at Ray's worker niceness (15), so
the test process keeps its priority; what is read back is the kernel's own record.
"""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest

from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.engine_process import EngineProcess
from engine.process import URGENT_NICE, apply_cpu_priority
from testing.engine_helpers import TEST_ENGINE_CONFIG

RAY_WORKER_NICE = 15
NOBODY = 65534


def _read_back(priority: str, unprivileged: bool) -> tuple[int, int, bool, str]:
    """In a fresh process at Ray's niceness: apply `priority`, return the policy, nice value,
    whether the process leads a session of its own, and its autogroup line."""
    os.nice(RAY_WORKER_NICE - os.nice(0))
    if unprivileged:
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    apply_cpu_priority(priority)
    autogroup = Path("/proc/self/autogroup")
    return (
        os.sched_getscheduler(0),
        os.getpriority(os.PRIO_PROCESS, 0),
        os.getsid(0) == os.getpid(),
        autogroup.read_text().strip() if autogroup.exists() else "",
    )


def read_back(priority: str, unprivileged: bool = False) -> tuple[int, int, bool, str]:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_read_back, (priority, unprivileged))


@pytest.mark.skipif(os.geteuid() != 0, reason="undoing Ray's niceness needs root here")
def test_urgent_undoes_rays_niceness_in_a_group_of_its_own() -> None:
    policy, nice, own_session, autogroup = read_back("urgent")
    assert policy == os.SCHED_OTHER and nice == URGENT_NICE and own_session
    assert not autogroup or autogroup.endswith(f"nice {URGENT_NICE}")


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to nobody needs root")
def test_urgent_without_privileges_keeps_its_niceness_and_starts() -> None:
    policy, nice, own_session, _ = read_back("urgent", unprivileged=True)
    assert policy == os.SCHED_OTHER and nice == RAY_WORKER_NICE and own_session


def test_own_group_leads_a_session_of_its_own_at_its_niceness() -> None:
    """A throughput pool's engine in an autogroup of its own: Ray's other workers no longer
    share its group's CPU time, and it keeps the niceness it was started with."""
    policy, nice, own_session, autogroup = read_back("own_group")
    assert policy == os.SCHED_OTHER and nice == RAY_WORKER_NICE and own_session
    assert not autogroup or autogroup.endswith("nice 0")


def test_inherit_changes_nothing() -> None:
    policy, nice, own_session, _ = read_back("inherit")
    assert policy == os.SCHED_OTHER and nice == RAY_WORKER_NICE and not own_session


def test_a_priority_needs_the_engine_in_a_process_of_its_own() -> None:
    with pytest.raises(ValueError, match="separate_process"):
        EngineConfig(cpu_priority="urgent")
    with pytest.raises(ValueError, match="cpu_priority must be one of"):
        EngineConfig(cpu_priority="background", separate_process=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="undoing the test's niceness needs root here")
def test_the_engine_child_takes_its_pools_priority_and_its_parent_keeps_its_own() -> None:
    config = EngineConfig(**TEST_ENGINE_CONFIG, separate_process=True, cpu_priority="urgent")
    engine = AsyncLLMEngine(config)
    assert isinstance(engine.core, EngineProcess)
    child = engine.core._process.pid
    assert child is not None
    assert os.getpriority(os.PRIO_PROCESS, child) == URGENT_NICE
    assert os.getsid(child) == child != os.getsid(0)
    assert os.getpriority(os.PRIO_PROCESS, 0) != URGENT_NICE
