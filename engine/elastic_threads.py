"""Threads that follow the node's demand: a pool's engine takes the cores the others leave.

Engines on one machine share its cores. A pool sized for co-location (the interactive
pool's one thread beside the offline pool's) leaves a core idle whenever the other pools
have nothing to do, and then serves at half the speed it could: at 4 streams, 1.57x the
tokens a second with 2 threads here (bench.engine.bench_peer). With
`EngineConfig.num_threads_alone`, an engine steps with that many threads while no other
engine on the machine has work, and with `num_threads` as soon as one has.

Every engine loop says when it has work (`NodeDemand.mark_busy`, the modification time of
a file of its own in a machine-local directory, at most every MARK_INTERVAL_S); an
elastic engine reads the others' before each step. A file rather than a Ray actor or a
socket: the engine stays free of Ray, and a read is a directory scan of a few entries.
An engine counts as busy until STALE_S after its last mark, so a pool between two
steps, or waiting out a slow one, still holds its core. What a busy engine asks for is
its demand, not the CPU it got: an engine starved by an elastic one still marks itself,
and the elastic one gives the core back at its next step.

Thread count and output: the engine's matmuls and kernels give the same bits at 1 and 2
threads (checked step by step in tests/unit/engine/test_elastic_threads.py), so a seeded
request's text does not depend on what the other pools were doing.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch

DEMAND_DIR = Path(tempfile.gettempdir()) / "tierserve-node-demand"
MARK_INTERVAL_S = 0.1
STALE_S = 0.5
"""An engine marked within this long is busy: five marks' worth, so one long step (a
decode step at 64 sequences is half a second here) does not read as idle."""
FORGET_AFTER_S = 3600.0
"""Files of engines gone this long (a killed process never removes its own) are deleted."""


class NodeDemand:
    """This engine's mark of having work, and whether any other engine's is fresh."""

    def __init__(self, directory: Path = DEMAND_DIR) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self._directory = directory
        self._own = directory / f"{os.getpid()}-{id(self)}"
        self._marked_s = 0.0
        _forget_old(directory)

    def mark_busy(self) -> None:
        """This engine has work now (a step is about to run)."""
        now_s = time.time()
        if now_s - self._marked_s >= MARK_INTERVAL_S:
            self._own.touch()
            self._marked_s = now_s

    def others_busy(self) -> bool:
        """Another engine on this machine marked itself within STALE_S."""
        fresh_after_s = time.time() - STALE_S
        with os.scandir(self._directory) as entries:
            return any(
                entry.name != self._own.name and _mtime_s(entry) >= fresh_after_s
                for entry in entries
            )

    def close(self) -> None:
        """This engine is gone: its mark with it."""
        self._own.unlink(missing_ok=True)


class ElasticThreads:
    """Before each step: `alone` threads while no other engine has work, else `shared`."""

    def __init__(self, shared: int, alone: int, demand: NodeDemand) -> None:
        self.shared = shared
        self.alone = alone
        self._demand = demand

    def before_step(self) -> None:
        """Set torch's thread count (the C kernels' too: they run on its OpenMP threads)."""
        threads = self.shared if self._demand.others_busy() else self.alone
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)


def _mtime_s(entry: os.DirEntry) -> float:
    try:
        return entry.stat().st_mtime
    except FileNotFoundError:  # removed by its engine since the scan listed it
        return 0.0


def _forget_old(directory: Path) -> None:
    forget_before_s = time.time() - FORGET_AFTER_S
    with os.scandir(directory) as entries:
        for entry in entries:
            if _mtime_s(entry) < forget_before_s:
                Path(entry.path).unlink(missing_ok=True)
