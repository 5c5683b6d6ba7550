"""Each pool's live load as the ingress sees it: requests in flight and polled engine stats.

In-flight counts are kept here, exact and instant, so routing and admission
react to a burst before the next poll. Engine stats (KV usage, queue,
prefix-cache counters) are polled from every replica for metrics and for
the live replica count that sizes a pool's capacity.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from deployments.config import PoolConfig
from deployments.pool import ReplicaStats
from engine.outputs import EngineStats
from policies.routing import PoolLoad

log = logging.getLogger(__name__)

STALE_AFTER_POLLS = 3
"""A replica not heard from in this many poll periods is counted as gone."""


@dataclass
class _Seen:
    stats: EngineStats
    at_s: float


class PoolMonitor:
    def __init__(
        self, pools: dict[str, PoolConfig], handles: dict[str, Any], poll_interval_s: float
    ):
        self._pools = pools
        self._handles = handles
        self._poll_interval_s = poll_interval_s
        self._in_flight = dict.fromkeys(pools, 0)
        self._replicas: dict[str, dict[str, _Seen]] = {name: {} for name in pools}
        self.replica_seconds = dict.fromkeys(pools, 0.0)
        """Replica time spent so far per pool: the basis of the cost metric."""

    @contextmanager
    def in_flight(self, pool: str, count: int) -> Iterator[None]:
        """Count `count` sequences as running on `pool` for the duration of the block."""
        self._in_flight[pool] += count
        try:
            yield
        finally:
            self._in_flight[pool] -= count

    def load(self, pool: str) -> PoolLoad:
        config = self._pools[pool]
        return PoolLoad(
            num_in_flight=self._in_flight[pool],
            capacity=config.engine.max_num_seqs * max(1, len(self.replica_stats(pool))),
            max_queued=config.max_queued_requests,
            max_request_tokens=config.max_request_tokens,
        )

    def loads(self) -> dict[str, PoolLoad]:
        return {name: self.load(name) for name in self._pools}

    def replica_stats(self, pool: str) -> list[EngineStats]:
        """The latest stats of each live replica of `pool`."""
        fresh_after_s = time.monotonic() - STALE_AFTER_POLLS * self._poll_interval_s
        return [seen.stats for seen in self._replicas[pool].values() if seen.at_s >= fresh_after_s]

    async def poll_forever(self) -> None:
        """Refresh replica stats every period; runs for the life of the ingress."""
        while True:
            await self.poll_once()
            for name in self._pools:
                self.replica_seconds[name] += len(self.replica_stats(name)) * self._poll_interval_s
            await asyncio.sleep(self._poll_interval_s)

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(name) for name in self._pools))

    async def _poll(self, pool: str) -> None:
        # Serve routes each call to some replica; asking as often as there can be
        # replicas reaches most of them each period, and stale ones age out.
        calls = [self._handles[pool].stats.remote() for _ in range(self._pools[pool].max_replicas)]
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, ReplicaStats):
                self._replicas[pool][result.replica_id] = _Seen(result.engine, time.monotonic())
            else:
                log.warning("stats poll of pool %s failed: %r", pool, result)
