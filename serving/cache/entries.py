"""A cache entry and the interface of the stores that keep entries (memory, Redis).

A store owns the entries' bounds (count, bytes, age) and their answers; the local
vector index (serving/cache/index.py) owns the search. A store tells the index what it
evicted, and, when shared, what other replicas added since the last look.
"""

from __future__ import annotations

import json
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class CacheEntry:
    """A stored answer, the key it answers under and the vector it is found by."""

    key: str
    vector: np.ndarray  # [dim] float32, unit length
    answer: dict[str, Any]
    """The `chat.completion` body as it was returned."""
    created_s: float = field(default_factory=time.time)
    """Wall-clock time (shared across replicas and machines, unlike a monotonic clock)."""
    entry_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def answer_json(self) -> bytes:
        """The answer as stored: compact JSON."""
        return json.dumps(self.answer, separators=(",", ":")).encode()

    @property
    def nbytes(self) -> int:
        """What the entry costs against the byte bound: vector, answer and key."""
        return self.vector.nbytes + len(self.answer_json) + len(self.key)

    def expired(self, ttl_s: float, now_s: float | None = None) -> bool:
        """Older than the time-to-live."""
        return (now_s if now_s is not None else time.time()) - self.created_s > ttl_s


@dataclass(frozen=True)
class StoreBounds:
    """What a store may hold: entries, bytes and age."""

    max_entries: int
    max_bytes: int
    ttl_s: float


class CacheStore(ABC):
    """Where entries live; every method may do I/O (the Redis store talks to a server)."""

    @abstractmethod
    async def put(self, entry: CacheEntry) -> list[str]:
        """Store `entry`; the ids evicted to keep the bounds (least recently used and
        expired first)."""

    @abstractmethod
    async def get(self, entry_id: str) -> CacheEntry | None:
        """The entry, marked as just used; None once evicted or expired."""

    @abstractmethod
    async def added_elsewhere(self) -> list[CacheEntry]:
        """Entries other replicas stored since the last call (a private store: none)."""

    @abstractmethod
    async def close(self) -> None:
        """Release connections."""
