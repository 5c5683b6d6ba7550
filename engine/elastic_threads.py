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
not the CPU it got, so an engine starved by an elastic one still counts. A file whose
process has died (killed before it could remove it) is deleted by the next reader.

Thread count and output: the engine's matmuls and kernels give the same bits at 1 and 2
threads (checked step by step in tests/unit/engine/test_elastic_threads.py), so a seeded
request's text does not depend on what the other pools were doing.
"""

from __future__ import annotations

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
        self._own = directory / f"{os.getpid()}-{id(self)}"
        self._busy = False

    def set_busy(self, busy: bool) -> None:
        """This engine has work now (a step is about to run), or has none left."""
        if busy and not self._busy:
            self._own.touch()
        elif self._busy and not busy:
            self._own.unlink(missing_ok=True)
        self._busy = busy

    def others_busy(self) -> bool:
        """Another live engine on this machine has declared work."""
        with os.scandir(self._directory) as entries:
            others = [e.name for e in entries if e.name != self._own.name]
        return any(_declared_by_live_process(self._directory / name) for name in others)

    def close(self) -> None:
        """This engine is gone: its declaration with it."""
        self.set_busy(False)


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


def _declared_by_live_process(path: Path) -> bool:
    """The declaration's process (the pid its name starts with) still runs; a dead one's
    file is deleted."""
    pid = int(path.name.split("-", 1)[0])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        path.unlink(missing_ok=True)
        return False
    except PermissionError:  # another user's process: alive
        pass
    return True
