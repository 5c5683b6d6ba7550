"""The worker ranks of a tensor-parallel engine, as rank 0 (the engine's process) sees them.

Each worker is a process of its own (started with subprocess, since an engine's
own child process is daemonic and multiprocessing forbids those children): it
loads the same model, keeps its slice (engine.parallel.shard) and a KV cache of
its KV heads, then runs every forward pass rank 0 runs, on the packed tokens rank 0
sends down a pipe before each. The scheduler, the sampler and the request state
live on rank 0 alone. The ranks sum their partial products through shared
memory (engine.parallel.shm_sum), and through a gloo process group of their own
for a tensor too large for its slots (not torch.distributed's global group: a
test or a benchmark may hold several engines in one process).

A worker that dies breaks the engine: the next step's send, or the sum the
worker never joins, raises `RankLost`, and the engine loop then stops for good
(its streams end with an error, its health check fails, Serve replaces it).
A worker exits when rank 0's end of its pipe closes, so none outlives its engine.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.model.model_runner import PackedTokens
from engine.parallel.errors import RankLost
from engine.parallel.shard import AllReduce
from engine.parallel.shm_sum import SharedMemorySum

HOST = "127.0.0.1"
GROUP_TIMEOUT = timedelta(seconds=60)
"""How long a sum waits for a rank before it raises: past every healthy step."""
START_TIMEOUT_S = 600.0
"""A worker's start (the model loaded and sliced, once per engine) before it is given up."""


@dataclass(frozen=True)
class RankStart:
    """What a worker needs to build its rank, sent first down its pipe."""

    config: EngineConfig
    rank: int
    store_port: int
    shm_name: str
    """The shared-memory segment of the ranks' sums (engine.parallel.shm_sum)."""
    max_sum_elements: int


def make_group(store: dist.Store, rank: int, world_size: int) -> dist.ProcessGroup:
    """This rank's gloo group over `store` (blocks until every rank has joined)."""
    return dist.ProcessGroupGloo(store, rank, world_size, GROUP_TIMEOUT)


def max_sum_elements(config: EngineConfig, hidden_size: int) -> int:
    """The largest partial product a step sums: a full token budget of hidden states."""
    return config.max_num_batched_tokens * hidden_size


def summing(group: dist.ProcessGroup, shm: SharedMemorySum) -> AllReduce:
    """An in-place sum of a tensor over the ranks: through shared memory, or through the
    gloo group for a tensor larger than its slots (every rank decides alike)."""

    def all_reduce(tensor: torch.Tensor) -> None:
        if shm.fits(tensor):
            shm(tensor)
            return
        try:
            group.allreduce([tensor]).wait()
        except RuntimeError as exc:
            raise RankLost(f"a tensor-parallel rank left the sum: {exc}") from exc

    return all_reduce


class WorkerRanks:
    """Ranks 1..N-1 of one engine: started, joined into the group, fed each step."""

    def __init__(self, config: EngineConfig, hidden_size: int) -> None:
        """Start the workers and join their group; each then loads its slice of the model
        until `start_runners`. `all_reduce` is rank 0's sum."""
        world_size = config.tensor_parallel_size
        self._store = dist.TCPStore(
            HOST, 0, world_size, is_master=True, timeout=GROUP_TIMEOUT, wait_for_workers=False
        )
        elements = max_sum_elements(config, hidden_size)
        self._shm = SharedMemorySum(None, world_size, 0, elements, self._all_alive)
        self._workers = [
            _Worker.start(RankStart(config, rank, self._store.port, self._shm.name, elements))
            for rank in range(1, world_size)
        ]
        self.all_reduce = summing(make_group(self._store, 0, world_size), self._shm)

    def _all_alive(self) -> bool:
        return all(worker.process.poll() is None for worker in self._workers)

    def start_runners(self, num_blocks: int) -> None:
        """Tell every worker its KV cache's size (rank 0 sized it) and wait until each has
        built its runner; RuntimeError with a worker's own start-up error."""
        for worker in self._workers:
            worker.send(num_blocks)
        for worker in self._workers:
            worker.await_ready()

    def send_step(self, tokens: PackedTokens) -> None:
        """Hand every worker the forward pass rank 0 is about to run."""
        payload = pickle.dumps(tokens)
        for worker in self._workers:
            worker.send_bytes(payload)

    def close(self) -> None:
        """Stop the workers (they exit when their pipe closes) and reap them."""
        for worker in self._workers:
            worker.stop()
        self._shm.close()


@dataclass
class _Worker:
    process: subprocess.Popen
    to_worker: Connection
    from_worker: Connection

    @classmethod
    def start(cls, start: RankStart) -> _Worker:
        """Spawn the worker with a pipe each way and send it its `RankStart`."""
        down_read, down_write = os.pipe()
        up_read, up_write = os.pipe()
        process = subprocess.Popen(
            [sys.executable, "-m", "engine.parallel.worker", str(down_read), str(up_write)],
            pass_fds=(down_read, up_write),
        )
        os.close(down_read)
        os.close(up_write)
        worker = cls(process, Connection(down_write, readable=False),
                     Connection(up_read, writable=False))  # fmt: skip
        worker.send(start)
        return worker

    def send(self, message: object) -> None:
        """Pickle `message` down the worker's pipe."""
        self.send_bytes(pickle.dumps(message))

    def send_bytes(self, payload: bytes) -> None:
        """`payload` down the pipe; RankLost when the worker is gone."""
        try:
            self.to_worker.send_bytes(payload)
        except OSError as exc:
            raise RankLost(f"tensor-parallel worker {self.process.pid} is gone ({exc!r}, "
                           f"exit code {self.process.poll()})") from exc  # fmt: skip

    def await_ready(self) -> None:
        """Block until the worker says it is ready; its start-up error, or its death, raised."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.from_worker.poll(1.0):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"tensor-parallel worker {self.process.pid} did not start "
                    f"(exit code {self.process.poll()})"
                )
        status = pickle.loads(self.from_worker.recv_bytes())
        if status != "ready":
            raise RuntimeError(f"tensor-parallel worker failed to start: {status}")

    def stop(self) -> None:
        """Close the pipes (the worker then exits) and reap it, killed after 10 s."""
        self.to_worker.close()
        self.from_worker.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
