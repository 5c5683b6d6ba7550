"""Process-wide settings, applied once by whoever owns the process (pool replica, CLI, bench).

An engine never changes them itself: two engines in one process (a test, a
benchmark comparing configs) must not fight over torch's global thread pool.
An engine's own child process (engine.engine_process) also takes its pool's
CPU priority here (apply_cpu_priority).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.model.batch_invariance import request_reproducible_blas

log = logging.getLogger(__name__)

URGENT_NICE = -10
"""The nice value of an urgent engine's process and autogroup: weight 9548 against 1024
for Ray's whole session (ingress, proxy, replicas, every other engine) and for a client's."""
_AUTOGROUP = Path("/proc/self/autogroup")


def configure_process(config: EngineConfig) -> None:
    """Set torch's intra-op thread count from `config.num_threads` (None leaves torch's own)
    and, for a batch-invariant engine, the BLAS's reproducible mode (before any matmul)."""
    if config.batch_invariant:
        request_reproducible_blas()
    if config.num_threads:
        torch.set_num_threads(config.num_threads)


def apply_cpu_priority(priority: str) -> None:
    """Give this process, an engine's child, its pool's claim on the node's cores.

    `urgent`: a session of its own, hence an autogroup of its own, at nice URGENT_NICE.
    Linux with autogroup on (the default on desktop and VM kernels, on here) shares the
    CPU between sessions first and by nice value only inside one: Ray starts every worker
    at nice 15 in one session, so a nice value alone would decide nothing against a
    client. Measured with bench/serving/bench_colocation.py (an interactive engine at batch 2
    beside an offline one at 48 sequences, each one thread, and half a core of Serve
    work in Ray's session): TPOT p50/p95 1.51x/2.75x alone as started, 1.00x/0.93x
    urgent. The offline engine then still took all that was left (82 tok/s, 0.50x
    alone: the half core the others left), where SCHED_IDLE for it gave 0.30x and nice
    19 0.16x (the load balancer leaves so light a task queued behind the urgent one),
    for no better TPOT; so a less urgent pool does not go below the priority it was
    started with. `own_group`: a session, hence an autogroup, of its own at the niceness it
    was started with, for a throughput pool: it shares the cores with Ray's whole session
    as an equal instead of inside it, beside the ingress, the proxy and the replicas.
    Measured beside an urgent interactive engine: bench_colocation --quick, offline
    throughput 0.583x alone against 0.548x in Ray's group; bench_sla --quick --slo-scale
    4.74, the offline engine 0.99 cores against 0.92 with no interactive load, and offline
    throughput beside the protected interactive load 0.58x without it against 0.44x.
    Raising the offline engine's group to nice -10 while it held an overflowed interactive
    request (bench_sla --quick --slo-scale 4.74, 2026-12-04) starved Ray's session instead:
    with both engines urgent, the hops through the ingress and the pool replicas took 1-3
    s of the interactive requests' first tokens, and their goodput under overload fell to
    0.35; so a pool's priority stays what its config says.
    Lowering a nice value needs privileges (CAP_SYS_NICE, or root as here): refused,
    it is logged and the engine starts in its own autogroup at nice 0, still a share
    equal to all of Ray's processes together.
    """
    if priority == "urgent":
        _own_session()
        _set_nice(URGENT_NICE)
    elif priority == "own_group":
        _own_session()


def _own_session() -> None:
    """A session of its own, hence an autogroup of its own (a no-op for a session leader)."""
    try:
        os.setsid()
    except OSError as error:
        log.info("engine process keeps its session: %s", error)


def _set_nice(nice: int) -> None:
    """This process's threads and its autogroup to `nice`; a refusal is logged, not raised."""
    try:
        for thread_id in os.listdir("/proc/self/task"):
            os.setpriority(os.PRIO_PROCESS, int(thread_id), nice)
        if _AUTOGROUP.exists():
            _AUTOGROUP.write_text(str(nice))
    except OSError as error:
        log.warning("engine process priority unchanged (nice %d refused: %s)", nice, error)
