"""How many replicas a pool needs, from its engines' queues and KV use.

Pure: numbers in, a replica count out (serving/pools/scaling.py reads the
numbers from Serve's autoscaling context). Serve's own policy counts ongoing
requests, which cannot tell a full batch from a long queue or a KV cache
about to preempt; the engines can.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

_EPS = 1e-9
"""Window means are floats: 2.0000000001 sequences must not ask for a third replica."""


@dataclass(frozen=True)
class ScalingTargets:
    """What one replica should carry at most."""

    max_num_seqs: int
    """The engine's batch cap: sequences one replica runs at once."""
    target_num_waiting_per_replica: float
    """Sequences allowed to queue per replica beyond its full batch."""
    target_kv_cache_usage: float
    """KV usage (0..1] per replica to stay under, leaving room before preemption."""


@dataclass(frozen=True)
class PoolDemand:
    """A pool's load summed over its replicas (each a mean over the look-back window)."""

    num_running: float
    num_waiting: float
    """Sequences in the engines' queues plus requests not yet sent to any replica."""
    kv_cache_usage: float
    """Sum of the replicas' KV usage fractions: replicas' worth of KV in use."""


def desired_num_replicas(
    demand: PoolDemand, targets: ScalingTargets, min_replicas: int, max_replicas: int
) -> int:
    """The fewest replicas that hold the demand within both targets, clipped to the bounds.

    Sequences: each replica holds a full batch plus its target queue.
    KV: each replica holds at most `target_kv_cache_usage` of its cache.
    The larger need wins; Serve's delays then keep one burst from flapping it.
    """
    per_replica_seqs = targets.max_num_seqs + targets.target_num_waiting_per_replica
    by_seqs = (demand.num_running + demand.num_waiting) / per_replica_seqs
    by_kv = demand.kv_cache_usage / targets.target_kv_cache_usage
    needed = math.ceil(max(by_seqs, by_kv) - _EPS)
    return min(max(needed, min_replicas), max_replicas)
