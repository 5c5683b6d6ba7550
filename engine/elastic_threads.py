"""Threads that follow the node's demand: a pool's engine takes the cores the others leave.

Engines on one machine share its cores. A pool sized for co-location (the interactive
pool's one thread beside the offline pool's) leaves a core idle whenever the other pools
have nothing to do, and then serves at half the speed it could: at 4 streams, 1.57x the
tokens a second with 2 threads here (bench.engine.bench_peer). With
`EngineConfig.num_threads_alone`, an engine steps with that many threads while no other
engine on the machine has work, and with `num_threads` as soon as one has.

Every engine loop says whether it has work (`NodeDemand.set_busy`: a file of its own
exists in a machine-local directory from its first step with work until it runs out of
work); an elastic engine reads the others' before each step. A file rather than a Ray
actor or a socket: the engine stays free of Ray, and a read is a directory scan of a few
entries. The file stands for the whole time an engine has work, not for a step: a step
of the offline pool takes up to a second here, and an engine that read "idle" during
it would take the core that step runs on. What a busy engine declares is its demand,
not the CPU it got, so an engine starved by an elastic one still counts.

The declaring engine holds a lock on its file (flock) for as long as the file stands, so
a reader tells a live declaration from a stale one by trying the lock: the kernel drops
a dead process's locks, however it died. A file judged by its process id alone looked
alive again once that id went to a new process: ids wrap at 32,768 here, every Serve
deployment starts dozens of processes, and nine files of killed engines from earlier
runs were found in the directory. A stale file is deleted by the reader that finds it.

Thread count and output: the engine's matmuls and kernels give the same bits at 1 and 2
threads (checked step by step in tests/unit/engine/test_elastic_threads.py), so a seeded
request's text does not depend on what the other pools were doing.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import tempfile
from pathlib import Path

import torch

DEMAND_DIR = Path(tempfile.gettempdir()) / "tierserve-node-demand"


class NodeDemand:
    """This engine's declaration of having work, and whether any other engine's stands."""

    def __init__(self, directory: Path = DEMAND_DIR) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self._directory = directory
        self._prefix = f"{os.getpid()}-{id(self)}-"
        """Its declarations' names start with this, and no other engine's do."""
        self._declarations = itertools.count()
        self._declared: tuple[Path, int] | None = None
        """The standing declaration's file and the descriptor holding its lock."""

    def set_busy(self, busy: bool) -> None:
        """This engine has work now (a step is about to run), or has none left."""
        if busy and self._declared is None:
            self._declared = self._declare()
        elif not busy and self._declared is not None:
            path, fd = self._declared
            path.unlink(missing_ok=True)
            os.close(fd)
            self._declared = None

    def others_busy(self) -> bool:
        """Another live engine on this machine has declared work."""
        with os.scandir(self._directory) as entries:
            others = [
                e.name for e in entries
                if not e.name.startswith((".", self._prefix))
            ]  # fmt: skip
        return any(_stands(self._directory / name) for name in others)

    def close(self) -> None:
        """This engine is gone: its declaration with it."""
        self.set_busy(False)

    def _declare(self) -> tuple[Path, int]:
        """A new file, locked before it is given its readable name (a reader never finds
        it unlocked), and a name never used before, so a reader deleting a stale file
        never deletes a later one."""
        name = f"{self._prefix}{next(self._declarations)}"
        hidden = self._directory / f".{name}"
        fd = os.open(hidden, os.O_CREAT | os.O_WRONLY, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        path = self._directory / name
        hidden.rename(path)
        return path, fd


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


def _stands(path: Path) -> bool:
    """The declaration's engine still holds its lock; a stale one's file is deleted."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:  # withdrawn meanwhile
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        path.unlink(missing_ok=True)
        return False
    finally:
        os.close(fd)
