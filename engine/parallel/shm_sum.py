"""The ranks' sum through shared memory: the ranks of one engine share a node.

gloo sums over TCP, even on one machine: about 0.7 ms a call here, and a decode
step of a 30-layer model makes 60 calls (42% of a 64-sequence step at TP=2,
bench_parallel). Here each rank copies its partial product into its slot of a
buffer every rank maps, raises its flag, waits for every other rank's flag,
and adds the slots in rank order: every rank computes the same sum, bit for
bit, with no copy through the kernel. Two buffers alternate, so a rank that
runs ahead into the next sum writes where no rank still reads: to get there it
saw every flag of this sum raised, so every rank has finished the previous one.

Waiting spins briefly and then yields the core (the other ranks, or the other
pools' engines, may need it), and gives up with RankLost when a peer is gone.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from multiprocessing import resource_tracker, shared_memory

import numpy as np
import torch

from engine.parallel.errors import RankLost

HOT_SPINS = 200
"""Flag reads before a waiting rank starts yielding its core between reads."""
LIVENESS_PERIOD_S = 0.1


class SharedMemorySum:
    """An in-place sum over `world_size` ranks of tensors of up to `max_elements` elements."""

    def __init__(
        self,
        name: str | None,
        world_size: int,
        rank: int,
        max_elements: int,
        peers_alive: Callable[[], bool],
    ) -> None:
        """Rank 0 creates the segment (`name` None: a fresh one, `self.name` says which),
        the others attach to it by name."""
        self.world_size, self.rank, self.max_elements = world_size, rank, max_elements
        self._peers_alive = peers_alive
        slot_bytes = max_elements * 4
        size = 8 * world_size + 2 * world_size * slot_bytes
        self._segment = shared_memory.SharedMemory(name=name, create=name is None, size=size)
        if name is not None:  # rank 0 owns the segment: attaching must not unlink it at exit
            resource_tracker.unregister(self._segment._name, "shared_memory")  # type: ignore[attr-defined]
        self.name = self._segment.name
        buffer = self._segment.buf
        self._flags = np.ndarray((world_size,), dtype=np.int64, buffer=buffer)
        if name is None:
            self._flags[:] = 0
        self._slots = torch.frombuffer(buffer, dtype=torch.uint8, offset=8 * world_size)
        self._slot_bytes = slot_bytes
        self._views: dict[torch.dtype, list[list[torch.Tensor]]] = {}
        """Per dtype, each buffer's slots as flat tensors of their whole capacity."""
        self._round = 0

    def fits(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` fits a slot (larger ones are summed through gloo)."""
        return tensor.numel() <= self.max_elements and tensor.element_size() <= 4

    def __call__(self, tensor: torch.Tensor) -> None:
        """Replace `tensor` (the same shape on every rank) with its sum over the ranks."""
        self._round += 1
        numel, shape = tensor.numel(), tensor.shape
        slots = self._buffer_slots(tensor.dtype)[self._round % 2]
        slots[self.rank][:numel].copy_(tensor.reshape(-1))
        self._flags[self.rank] = self._round
        self._await_round()
        torch.add(slots[0][:numel].view(shape), slots[1][:numel].view(shape), out=tensor)
        for slot in slots[2:]:
            tensor.add_(slot[:numel].view(shape))

    def _buffer_slots(self, dtype: torch.dtype) -> list[list[torch.Tensor]]:
        if dtype not in self._views:
            per_slot = self._slot_bytes // torch.empty((), dtype=dtype).element_size()
            flat = self._slots.view(dtype)
            self._views[dtype] = [
                [flat[(b * self.world_size + r) * per_slot :][:per_slot]
                 for r in range(self.world_size)]
                for b in range(2)
            ]  # fmt: skip
        return self._views[dtype]

    def _await_round(self) -> None:
        spins, checked = 0, time.monotonic()
        while self._flags.min() < self._round:
            spins += 1
            if spins < HOT_SPINS:
                continue
            os.sched_yield()
            if time.monotonic() - checked > LIVENESS_PERIOD_S:
                checked = time.monotonic()
                if not self._peers_alive():
                    raise RankLost("a tensor-parallel rank died during a sum")

    def close(self) -> None:
        """Unmap the segment; rank 0 also removes it."""
        del self._flags, self._slots, self._views
        self._segment.close()
        if self.rank == 0:
            self._segment.unlink()
