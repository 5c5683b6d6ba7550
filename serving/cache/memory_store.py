"""Entries in this ingress replica's memory: least recently used first out, past a bound
on entries or bytes, and never returned past their time-to-live."""

from __future__ import annotations

import time
from collections import OrderedDict, deque

from serving.cache.entries import CacheEntry, CacheStore, StoreBounds


class MemoryStore(CacheStore):
    """One replica's entries, in least-recently-used order."""

    def __init__(self, bounds: StoreBounds) -> None:
        self._bounds = bounds
        self._entries: OrderedDict[str, CacheEntry] = OrderedDict()
        self._nbytes = 0
        self._by_age: deque[tuple[float, str]] = deque()
        """(created, id) in the order stored: the expired are found at its front."""

    @property
    def nbytes(self) -> int:
        """Bytes held, as counted against `max_bytes`."""
        return self._nbytes

    def __len__(self) -> int:
        return len(self._entries)

    async def put(self, entry: CacheEntry) -> list[str]:
        """Store `entry` as the most recently used; evict the expired, then the least
        recently used while over a bound."""
        self._entries[entry.entry_id] = entry
        self._nbytes += entry.nbytes
        self._by_age.append((entry.created_s, entry.entry_id))
        evicted = []
        expired_before_s = time.time() - self._bounds.ttl_s
        while self._by_age and self._by_age[0][0] < expired_before_s:
            _, entry_id = self._by_age.popleft()
            if entry_id in self._entries:  # not already gone by LRU
                evicted.append(self._drop(entry_id))
        while (
            len(self._entries) > self._bounds.max_entries or self._nbytes > self._bounds.max_bytes
        ):
            evicted.append(self._drop(next(iter(self._entries))))
        return evicted

    async def get(self, entry_id: str) -> CacheEntry | None:
        """The entry, moved to most recently used; None if gone or expired (then dropped)."""
        entry = self._entries.get(entry_id)
        if entry is None:
            return None
        if entry.expired(self._bounds.ttl_s):
            self._drop(entry_id)
            return None
        self._entries.move_to_end(entry_id)
        return entry

    def _drop(self, entry_id: str) -> str:
        self._nbytes -= self._entries.pop(entry_id).nbytes
        return entry_id

    async def added_elsewhere(self) -> list[CacheEntry]:
        """A replica's own memory: nobody else adds."""
        return []

    async def close(self) -> None:
        """Nothing to release."""
