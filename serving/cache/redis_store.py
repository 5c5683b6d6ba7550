"""Entries shared by every ingress replica through Redis: vectors and answers live there,
each replica searches its own copy of the vectors (serving/cache/index.py).

Debian's redis-server 7.0 has no vector search module (RediSearch), so Redis holds the
entries and their order, and the search stays local: a replica loads every entry when
it starts and, at each lookup, the entries added since its last look (one round trip:
a sorted set of entry ids scored by a sequence number). An entry another replica
evicted is found missing when its answer is read, and dropped from the local index
then.

Keys under the namespace `ns`: `ns:e:<id>` (a hash: key, vector, answer, created; it
expires with the TTL), `ns:lru` (id by last use), `ns:created` (id by creation),
`ns:log` (id by sequence), `ns:seq`, `ns:sizes` (id -> bytes) and `ns:bytes` (their
sum). Removal is one Lua script, so two replicas evicting the same entry count its
bytes out once.
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import redis.asyncio as redis

from serving.cache.entries import CacheEntry, CacheStore, StoreBounds

_REMOVE = """
local size = redis.call('HGET', KEYS[1], ARGV[1])
if not size then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('DECRBY', KEYS[2], size)
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
redis.call('ZREM', KEYS[5], ARGV[1])
redis.call('DEL', KEYS[6])
return 1
"""
"""Forget one entry everywhere, its bytes counted out only by the caller that removed it."""


class RedisStore(CacheStore):
    """Entries in Redis under `namespace`, bounded like the memory store."""

    def __init__(self, url: str, namespace: str, bounds: StoreBounds) -> None:
        self._redis = redis.Redis.from_url(url)
        self._ns = namespace
        self._bounds = bounds
        self._remove = self._redis.register_script(_REMOVE)
        self._last_seq = 0.0
        """The sequence number of the newest entry this replica has seen."""

    def _key(self, name: str) -> str:
        return f"{self._ns}:{name}"

    async def put(self, entry: CacheEntry) -> list[str]:
        """Store `entry` (with Redis's own expiry at the TTL), then evict past the bounds."""
        seq = await self._redis.incr(self._key("seq"))
        ttl_ms = int(self._bounds.ttl_s * 1000)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(self._key(f"e:{entry.entry_id}"), mapping=_fields(entry))
            pipe.pexpire(self._key(f"e:{entry.entry_id}"), ttl_ms)
            pipe.hset(self._key("sizes"), entry.entry_id, entry.nbytes)
            pipe.incrby(self._key("bytes"), entry.nbytes)
            pipe.zadd(self._key("lru"), {entry.entry_id: time.time()})
            pipe.zadd(self._key("created"), {entry.entry_id: entry.created_s})
            pipe.zadd(self._key("log"), {entry.entry_id: seq})
            await pipe.execute()
        return await self._evict()

    async def _evict(self) -> list[str]:
        """The expired entries, then the least recently used while over a bound."""
        expired_before = time.time() - self._bounds.ttl_s
        evicted = [
            _text(i)
            for i in await self._redis.zrangebyscore(self._key("created"), "-inf", expired_before)
        ]
        for entry_id in evicted:
            await self._drop(entry_id)
        while await self._over_bounds():
            oldest = await self._redis.zrange(self._key("lru"), 0, 0)
            if not oldest:
                break
            evicted.append(_text(oldest[0]))
            await self._drop(evicted[-1])
        return evicted

    async def _over_bounds(self) -> bool:
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.zcard(self._key("lru"))
            pipe.get(self._key("bytes"))
            count, nbytes = await pipe.execute()
        return count > self._bounds.max_entries or int(nbytes or 0) > self._bounds.max_bytes

    async def _drop(self, entry_id: str) -> None:
        names = ("sizes", "bytes", "lru", "created", "log", f"e:{entry_id}")
        await self._remove(keys=[self._key(n) for n in names], args=[entry_id])

    async def get(self, entry_id: str) -> CacheEntry | None:
        """The entry, its last use set to now; None once evicted or expired anywhere."""
        fields = await self._redis.hgetall(self._key(f"e:{entry_id}"))
        if not fields:
            return None
        entry = _entry(entry_id, fields)
        if entry.expired(self._bounds.ttl_s):
            await self._drop(entry_id)
            return None
        await self._redis.zadd(self._key("lru"), {entry_id: time.time()}, xx=True)
        return entry

    async def added_elsewhere(self) -> list[CacheEntry]:
        """Entries stored since this replica's last look (its own included: the index
        ignores ids it holds); all of them at the first call."""
        found = await self._redis.zrangebyscore(
            self._key("log"), f"({self._last_seq}", "+inf", withscores=True
        )
        if not found:
            return []
        self._last_seq = max(score for _, score in found)
        ids = [_text(entry_id) for entry_id, _ in found]
        async with self._redis.pipeline(transaction=False) as pipe:
            for entry_id in ids:
                pipe.hgetall(self._key(f"e:{entry_id}"))
            rows = await pipe.execute()
        return [_entry(i, fields) for i, fields in zip(ids, rows, strict=True) if fields]

    async def close(self) -> None:
        """Close the connection pool."""
        await self._redis.aclose()


def _fields(entry: CacheEntry) -> dict[str, Any]:
    return {
        "key": entry.key,
        "vector": np.asarray(entry.vector, dtype="<f4").tobytes(),
        "answer": entry.answer_json,
        "created": entry.created_s,
    }


def _entry(entry_id: str, fields: dict[bytes, bytes]) -> CacheEntry:
    return CacheEntry(
        key=fields[b"key"].decode(),
        vector=np.frombuffer(fields[b"vector"], dtype="<f4").copy(),
        answer=json.loads(fields[b"answer"]),
        created_s=float(fields[b"created"]),
        entry_id=entry_id,
    )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
