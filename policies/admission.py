"""Admission control: shed the lowest tiers first when a pool's queue fills up."""

from __future__ import annotations

from policies.routing import PoolLoad
from policies.tiers import Tier


def should_shed(tier: Tier, load: PoolLoad, num_sequences: int = 1) -> bool:
    """Whether to answer 429 instead of queueing `num_sequences` more on this pool.

    Each sequence (a prompt sampled once) takes an engine slot, so a request
    of n x prompts counts as that many. Each tier may fill its own fraction
    of the pool's queue limit, so as the queue grows the batch tier is turned
    away first, then standard, and interactive only when the queue is full.
    Queueing without a bound would turn overload into timeouts for every tier.
    """
    queued_if_admitted = max(0, load.num_in_flight + num_sequences - load.capacity)
    return queued_if_admitted > tier.shed_at_queue_fraction * load.max_queued
