"""Replica choice for the pools (a Serve request router), fed by the engines' own load reports.

Thin glue over policies/replica_choice.py. Serve calls `choose_replicas` in the
caller's process (the ingress) for every request to a pool; the replicas'
`record_routing_stats` reach it through the controller once a stats period.
"""

from __future__ import annotations

from typing import Any

from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from engine.config import EngineConfig
from policies.replica_choice import (
    ChoiceSettings,
    PrefixAffinity,
    ReplicaLoad,
    prefix_hashes,
    rank_replicas,
)
from serving.config import ReplicaChoiceSettings
from serving.pools.pool import NewSequence

_STATS_KEYS = frozenset({"num_running", "num_waiting", "max_num_seqs", "kv_cache_usage"})


def replica_choice_config(
    settings: ReplicaChoiceSettings, engine: EngineConfig
) -> RequestRouterConfig:
    """The Serve option that puts ReplicaChooser in front of a pool's replicas."""
    options: dict[str, Any] = {  # Ray annotates every keyword of the constructor as a dict
        "request_router_class": ReplicaChooser,
        "request_router_kwargs": {
            "block_size": engine.block_size,
            "affinity_blocks": settings.affinity_blocks,
            "max_prefixes": settings.max_prefixes,
            "kv_cache_full": settings.kv_cache_full,
            "affinity_max_imbalance": settings.affinity_max_imbalance,
        },
        "request_routing_stats_period_s": settings.stats_period_s,
    }
    return RequestRouterConfig(**options)


class ReplicaChooser(FIFOMixin, RequestRouter):
    """Ranks a pool's replicas by free batch slots and KV use, keeping a shared prefix together.

    Each replica's load is its last routing stats, corrected upward by Serve's
    live count of the requests this chooser has sent it, so a burst between
    two stats reports spreads instead of piling onto the replica that looked
    idlest. Prompts are keyed by hashes of their leading KV blocks; the
    replica that last served a key gets the next prompt with it while it is
    not overloaded (policies.replica_choice.rank_replicas). Control calls
    (stats, model info) take the replicas in turn instead.

    FIFOMixin hands a replica found for one call to the oldest waiting call when
    none matches its id: the sequences of one request (n > 1, several prompts)
    share an id, and without it all but one would never be sent.
    """

    def initialize_state(  # type: ignore[override]
        self,
        block_size: int,
        affinity_blocks: int,
        max_prefixes: int,
        kv_cache_full: float,
        affinity_max_imbalance: float,
    ) -> None:
        """Called by Serve with `request_router_kwargs` (see replica_choice_config)."""
        self._block_size = block_size
        self._affinity_blocks = affinity_blocks
        self._affinity = PrefixAffinity(max_prefixes)
        self._settings = ChoiceSettings(kv_cache_full, affinity_max_imbalance)
        self._num_control_calls = 0

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """Every candidate, in ranks best first: Serve tries each rank before the next."""
        if pending_request is not None:
            # Every replica is already a candidate, so when none takes the request Serve
            # must back off before asking again. Left False (its default, meant for
            # locality passes), Serve re-asks at once and, as this method never awaits,
            # spins the event loop: queue-length probes time out and requests stall.
            pending_request.routing_context.should_backoff = True
        request = _pool_request(pending_request)
        if request is None:
            return self._in_turn(candidate_replicas)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = {replica_id: self._load(r) for replica_id, r in by_id.items()}
        known = [load for load in loads.values() if load is not None]
        unknown_ids = [replica_id for replica_id, load in loads.items() if load is None]
        preferred_id = self._affinity.lookup(self._prefix_hashes(request))
        ranks = rank_replicas(known, unknown_ids, preferred_id, self._settings)
        chosen = [[by_id[i] for i in rank if i in by_id] for rank in ranks]
        return [rank for rank in chosen if rank] or [candidate_replicas]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        """The chosen replica now holds the prompt's prefix: later prompts sharing it follow."""
        request = _pool_request(pending_request)
        if request is not None:
            self._affinity.record(self._prefix_hashes(request), replica_id.unique_id)

    def _in_turn(self, candidates: list[RunningReplica]) -> list[list[RunningReplica]]:
        """Control calls (stats, model info) do no work: each starts at the next replica in
        turn, so the ingress's stats polls reach busy replicas too, not only the idlest."""
        ordered = sorted(candidates, key=lambda r: r.replica_id.unique_id)
        start = self._num_control_calls % len(ordered)
        self._num_control_calls += 1
        return [[replica] for replica in ordered[start:] + ordered[:start]]

    def _load(self, replica: RunningReplica) -> ReplicaLoad | None:
        """The replica's load, or None before its first stats report (or when stats fail)."""
        stats = replica.routing_stats
        if not stats.keys() >= _STATS_KEYS:
            return None
        load = ReplicaLoad(
            replica_id=replica.replica_id.unique_id,
            num_running=int(stats["num_running"]),
            num_waiting=int(stats["num_waiting"]),
            max_num_seqs=int(stats["max_num_seqs"]),
            kv_cache_usage=float(stats["kv_cache_usage"]),
        )
        return load.with_ongoing(self.replica_queue_len_cache.get(replica.replica_id))

    def _prefix_hashes(self, request: NewSequence) -> list[int]:
        """Hashes of the prompt's leading blocks: the key of prefix-cache affinity."""
        return prefix_hashes(request.prompt_token_ids, self._block_size, self._affinity_blocks)


def _pool_request(pending_request: PendingRequest | None) -> NewSequence | None:
    """The generation a pending call carries; None for control calls (stats, model info)."""
    args = pending_request.args if pending_request is not None else []
    return args[0] if args and isinstance(args[0], NewSequence) else None
