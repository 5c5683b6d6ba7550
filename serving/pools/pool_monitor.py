"""Each pool's live load as the ingress sees it: sequences in flight and polled engine stats.

Sequences in flight are tracked here, exact and instant (priority, prompt
length, tokens so far), so placement reacts to a burst before the next poll.
Engine stats are polled from every replica: the fitted step cost that turns
that work into predicted latencies (policies/latency.py), KV usage and queue
for metrics. Which replicas are live is Serve's word, not the polls': a replica
counts while Serve's controller runs it (health-checked, told of lost nodes),
however long its last answer is ago. Counting silence instead refused pools with
503s whenever a loaded machine delayed every replica's answer for a few seconds.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ray.serve.context import _get_global_client
from ray.serve.handle import DeploymentHandle

from engine.outputs import EngineStats
from policies.pool_state import InFlightSequence, PoolState, StepCost
from policies.router_choice import ServedStudent
from serving.config import PoolConfig
from serving.pools.calls import within
from serving.pools.pool import ReplicaStats

log = logging.getLogger(__name__)

POLL_TIMEOUT_POLLS = 3
"""A stats call unanswered after this many poll periods is cancelled: a pool with no
live replica (its node lost) would otherwise hold every later poll of every pool."""


RunningReplicas = Callable[[], dict[str, int]]
"""Each pool's count of the replicas Serve runs now; blocking (a controller call)."""


TYPICAL_OUTPUT_TOKENS = 128
"""Expected output length before any request has finished on a pool."""
OUTPUT_EWMA = 0.1
"""Weight of each finished sequence in a pool's typical output length once the pool has
finished 1 / OUTPUT_EWMA of them; before that each weighs 1 / n (a plain mean), so the prior
is gone with the first finished sequence instead of biasing the first few dozen."""


@dataclass
class _Seen:
    stats: EngineStats
    at_s: float
    grammar_mask_s: float = 0.0
    student: ServedStudent | None = None


@dataclass(eq=False)
class SentSequence:
    """One sequence the ingress sent to a pool; the ingress updates its output count."""

    priority: int
    num_prompt_tokens: int
    max_tokens: int
    tpot_target_s: float | None = None
    """What the engine keeps it within (None: none, as for a downgraded request)."""
    num_output_tokens: int = 0


class PoolMonitor:
    """Each pool's live load for routing, admission, metrics and health."""

    def __init__(
        self,
        pools: dict[str, PoolConfig],
        handles: dict[str, Any],
        poll_interval_s: float,
        running_replicas: RunningReplicas | None = None,
    ):
        """Without `running_replicas` (tests without Serve) every replica heard from counts."""
        self._pools = pools
        self._handles = handles
        self._poll_interval_s = poll_interval_s
        self._running_replicas = running_replicas
        self._running: dict[str, int] | None = None
        """Serve's counts as last read; None until read (then every replica heard counts)."""
        self._in_flight: dict[str, list[SentSequence]] = {name: [] for name in pools}
        self._typical_output = dict.fromkeys(pools, float(TYPICAL_OUTPUT_TOKENS))
        self._num_finished = dict.fromkeys(pools, 0)
        self._replicas: dict[str, dict[str, _Seen]] = {name: {} for name in pools}
        self._max_model_len: dict[str, int] = {}
        self._unavailable: dict[str, str] = {}
        self.replica_seconds = dict.fromkeys(pools, 0.0)
        """Replica time spent so far per pool: the basis of the cost metric."""

    @contextmanager
    def track(self, pool: str, sequences: list[SentSequence]) -> Iterator[None]:
        """Count `sequences` as in flight on `pool` for the duration of the block; when it
        ends, their output lengths teach the pool's typical output length."""
        self._in_flight[pool].extend(sequences)
        try:
            yield
        finally:
            for sequence in sequences:
                self._in_flight[pool].remove(sequence)
                self._learn_output_length(pool, sequence.num_output_tokens)

    def _learn_output_length(self, pool: str, num_output_tokens: int) -> None:
        """Move the pool's typical output length toward a finished sequence's."""
        self._num_finished[pool] += 1
        weight = max(OUTPUT_EWMA, 1.0 / self._num_finished[pool])
        typical = self._typical_output[pool]
        self._typical_output[pool] = typical + weight * (num_output_tokens - typical)

    def state(self, pool: str) -> PoolState:
        """The pool now, as placement reads it (policies/latency.py)."""
        config = self._pools[pool]
        stats = self.replica_stats(pool)
        computed, gained = _tokens_per_decode(stats)
        return PoolState(
            name=pool,
            num_replicas=len(stats),
            max_num_seqs=self._kv_slots(pool),
            max_num_batched_tokens=config.engine.max_num_batched_tokens,
            cost=self._step_cost(pool),
            in_flight=tuple(self._in_flight_view(pool)),
            max_queued=config.max_queued_requests,
            cost_per_1k_tokens=config.estimated_cost_per_1k_tokens,
            max_request_tokens=config.max_request_tokens,
            prefill_step_limit_s=config.engine.prefill_step_limit_s,
            tokens_computed_per_decode=computed,
            tokens_gained_per_decode=gained,
            prompt_share_computed=_prompt_share_computed(stats),
            prompt_tokens_per_s=statistics.fmean(
                [s.prompt_tokens_computed_per_s for s in stats] or [0.0]
            ),
        )

    def states(self) -> dict[str, PoolState]:
        """Every pool's state."""
        return {name: self.state(name) for name in self._pools}

    def _in_flight_view(self, pool: str) -> Iterator[InFlightSequence]:
        typical = self._typical_output[pool]
        for s in self._in_flight[pool]:
            left = s.max_tokens - s.num_output_tokens
            expected = min(left, max(1.0, typical - s.num_output_tokens))
            yield InFlightSequence(
                s.priority, s.num_prompt_tokens, round(expected), s.num_output_tokens > 0,
                s.tpot_target_s,
            )  # fmt: skip

    def _kv_slots(self, pool: str) -> int:
        """Sequences a replica runs at once: max_num_seqs, or fewer where its KV cache holds
        fewer sequences of the size the pool is serving (a quantized cache holds more,
        EngineConfig.kv_cache_dtype); max_num_seqs until a replica reports its blocks."""
        engine = self._pools[pool].engine
        blocks = [s.num_kv_blocks for s in self.replica_stats(pool) if s.num_kv_blocks > 0]
        if not blocks:
            return engine.max_num_seqs
        in_flight = self._in_flight[pool]
        prompt = sum(s.num_prompt_tokens for s in in_flight) / len(in_flight) if in_flight else 0
        per_sequence = math.ceil((prompt + self._typical_output[pool]) / engine.block_size)
        return max(1, min(engine.max_num_seqs, min(blocks) // max(1, per_sequence)))

    def max_model_len(self, pool: str) -> int:
        """The pool's context length, as its replicas last reported it (placement only
        chooses pools with a live replica, so it has been heard)."""
        return self._max_model_len[pool]

    def reported_max_model_len(self, pool: str) -> int | None:
        """The pool's context length once a replica has reported it, else None."""
        return self._max_model_len.get(pool)

    def replica_stats(self, pool: str) -> list[EngineStats]:
        """The latest stats of each live replica of `pool`."""
        return [seen.stats for seen in self._live(pool)]

    def served_students(self, pool: str) -> list[ServedStudent | None]:
        """The student each live replica of `pool` serves (None: no distilled student), for
        the choice of the difficulty router (policies/router_choice.py)."""
        return [seen.student for seen in self._live(pool)]

    def _live(self, pool: str) -> list[_Seen]:
        """As many of the replicas heard from as Serve runs, the most recently heard first
        (a replaced replica's last stats are the oldest)."""
        heard = sorted(self._replicas[pool].values(), key=lambda seen: seen.at_s, reverse=True)
        running = len(heard) if self._running is None else self._running.get(pool, 0)
        return heard[:running]

    def _step_cost(self, pool: str) -> StepCost:
        """The live replicas' fitted step costs and measured grammar masks, averaged (zero
        before any replica reported; a prompt token at a decode's cost while one does not
        report its own)."""
        live = self._live(pool)
        if not live:
            return StepCost(0.0, 0.0, 0.0)

        def mean(term: Callable[[_Seen], float]) -> float:
            return sum(term(seen) for seen in live) / len(live)

        prompt_token_s = [seen.stats.step_cost.per_prompt_token_s for seen in live]
        return StepCost(
            base_s=mean(lambda seen: seen.stats.step_cost.base_s),
            per_seq_s=mean(lambda seen: seen.stats.step_cost.per_seq_s),
            per_token_s=mean(lambda seen: seen.stats.step_cost.per_token_s),
            per_constrained_row_s=mean(lambda seen: seen.grammar_mask_s),
            per_prompt_token_s=_mean_reported(prompt_token_s),
        )

    def unavailable_reason(self, pool: str) -> str | None:
        """Why a pool with no live replica is waiting (its model is still being made), as
        its replicas said; None for a pool that is live or simply down."""
        return None if self.replica_stats(pool) else self._unavailable.get(pool)

    async def poll_forever(self) -> None:
        """Refresh replica stats every period, each pool on its own clock (a pool whose
        calls go unanswered must not age the others' stats); runs for the life of the
        ingress."""
        await asyncio.gather(
            self._count_running_forever(), *(self._poll_forever(name) for name in self._pools)
        )

    async def _count_running_forever(self) -> None:
        while True:
            await asyncio.sleep(self._poll_interval_s)
            await self._count_running()

    async def _count_running(self) -> None:
        """Read Serve's running replica counts in a thread (the call blocks); an unanswered
        read keeps the last counts."""
        if self._running_replicas is None:
            return
        timeout_s = POLL_TIMEOUT_POLLS * self._poll_interval_s
        try:
            read = asyncio.to_thread(self._running_replicas)
            self._running = await asyncio.wait_for(read, timeout_s)
        except Exception as error:  # noqa: BLE001  (the controller busy or restarting)
            log.warning("reading Serve's running replicas failed: %r", error)

    async def _poll_forever(self, pool: str) -> None:
        last_s = time.monotonic()
        while True:
            await self._poll(pool)
            await asyncio.sleep(self._poll_interval_s)
            now_s = time.monotonic()
            self.replica_seconds[pool] += len(self.replica_stats(pool)) * (now_s - last_s)
            last_s = now_s

    async def poll_once(self) -> None:
        """Ask every pool's replicas for their stats, and Serve which run, once."""
        await asyncio.gather(self._count_running(), *(self._poll(name) for name in self._pools))

    async def _poll(self, pool: str) -> None:
        # Serve routes each call to some replica; asking as often as there can be
        # replicas reaches most of them each period, and stale ones age out.
        timeout_s = POLL_TIMEOUT_POLLS * self._poll_interval_s
        calls = [self._handles[pool].stats.remote() for _ in range(self._pools[pool].max_replicas)]
        answers = (within(call, timeout_s) for call in calls)
        for result in await asyncio.gather(*answers, return_exceptions=True):
            if not isinstance(result, ReplicaStats):
                log.warning("stats poll of pool %s failed: %r", pool, result)
            elif result.engine is None:  # alive, but its model is still being made
                self._unavailable[pool] = result.unavailable or "no engine yet"
            else:
                seen = _Seen(result.engine, time.monotonic(), result.grammar_mask_s, result.student)
                self._replicas[pool][result.replica_id] = seen
                self._max_model_len[pool] = result.max_model_len
                self._unavailable.pop(pool, None)


def _tokens_per_decode(stats: list[EngineStats]) -> tuple[float, float]:
    """A decoding sequence's tokens computed and gained per step, over the live replicas'
    speculation so far ((1, 1) where none speculates)."""
    if not stats:
        return 1.0, 1.0
    computed, gained = zip(*(s.spec_tokens_per_decode for s in stats), strict=True)
    return statistics.fmean(computed), statistics.fmean(gained)


def _prompt_share_computed(stats: list[EngineStats]) -> float:
    """Of the prompt tokens the live replicas looked up so far, the share they computed (1
    before any lookup): what their prefix caches did not hold."""
    queries = sum(s.prefix_cache_queries for s in stats)
    if not queries:
        return 1.0
    return 1.0 - sum(s.prefix_cache_hits for s in stats) / queries


def serve_running_replicas(handles: dict[str, DeploymentHandle]) -> RunningReplicas:
    """The pools' running replica counts as Serve's controller reports them (0 for a pool
    whose deployment it does not list, as while the app is being deleted).

    Read from the controller's details as the plain data it sends (the schema of
    `ray.serve.schema.ServeInstanceDetails`), not through `serve.status()`: that builds
    them into models whose deployment configs cloudpickle the request router class on
    every call, 39 ms of the ingress's CPU a call on an idle machine against 2 ms, and a
    sixth of its samples in bench_sla's first burst, where it held the event loop that
    forwards every first token."""

    def count() -> dict[str, int]:
        client = _get_global_client(raise_if_no_controller_running=False)
        applications = client.get_serve_details().get("applications", {}) if client else {}

        def running(handle: DeploymentHandle) -> int:
            deployments = applications.get(handle.app_name, {}).get("deployments", {})
            replicas = deployments.get(handle.deployment_name, {}).get("replicas", [])
            return sum(replica["state"] == "RUNNING" for replica in replicas)

        return {pool: running(handle) for pool, handle in handles.items()}

    return count


def _mean_reported(values: list[float | None]) -> float | None:
    """The mean of `values`, or None when any is missing."""
    if any(v is None for v in values):
        return None
    return sum(v for v in values if v is not None) / len(values)
