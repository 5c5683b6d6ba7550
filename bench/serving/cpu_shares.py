"""Where a serving deployment's CPU goes, by kind of process, over a window of a benchmark.

On a shared node every pool's engine, its Serve replica, the ingress, the proxy and
the client compete for the same cores; a throughput or latency figure says little
without knowing who ran. Processes are told apart by Ray's process titles
(`ray::ServeReplica:<app>:<deployment>`) and by parentage: an engine runs in a
spawned child of its pool's replica.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import psutil

REPLICA_TITLE = "ray::ServeReplica:tierserve:"


@dataclass(frozen=True)
class CpuSample:
    """CPU seconds (user + system) of each kind of process, at one instant."""

    at_s: float
    seconds: dict[str, float]

    def shares_since(self, earlier: CpuSample) -> dict[str, float]:
        """Each kind's CPU over the interval, as a share of one core (2.0: two busy cores)."""
        elapsed = self.at_s - earlier.at_s
        kinds = set(self.seconds) | set(earlier.seconds)
        return {
            kind: (self.seconds.get(kind, 0.0) - earlier.seconds.get(kind, 0.0)) / elapsed
            for kind in sorted(kinds)
        }


def sample() -> CpuSample:
    """CPU seconds so far of every process, summed by kind (processes that ended since an
    earlier sample drop out: compare samples of a steady phase)."""
    totals: dict[str, float] = {}
    for process in psutil.process_iter(["pid", "cmdline", "cpu_times"]):
        times = process.info["cpu_times"]
        if times is None:
            continue
        kind = _kind(process)
        totals[kind] = totals.get(kind, 0.0) + times.user + times.system
    return CpuSample(time.monotonic(), totals)


def _kind(process: psutil.Process) -> str:
    if process.info["pid"] == os.getpid():
        return "client"
    title = " ".join(process.info["cmdline"] or [])
    if title.startswith(REPLICA_TITLE):
        return "replica." + _actor(title.removeprefix(REPLICA_TITLE))
    if "multiprocessing.spawn" in title:
        parent = _parent_title(process)
        if parent.startswith(REPLICA_TITLE):
            return "engine." + _actor(parent.removeprefix(REPLICA_TITLE))
    if title.startswith("ray::"):
        return _actor(title)
    if "ray" in title or "raylet" in title or "gcs_server" in title:
        return "ray.other"
    return "other"


def _actor(title: str) -> str:
    """The actor's name without the method it runs now (Ray's title changes with it)."""
    return title.split()[0].split(".")[0]


def _parent_title(process: psutil.Process) -> str:
    try:
        parent = process.parent()
        return " ".join(parent.cmdline()) if parent is not None else ""
    except psutil.Error:
        return ""
