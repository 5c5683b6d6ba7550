"""Which pool serves a request, from its tier, its size and the pools' live load."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from policies.tiers import Tier


@dataclass(frozen=True)
class RequestFeatures:
    """What routing knows about a request before it runs."""

    num_prompt_tokens: int
    max_tokens: int

    @property
    def num_total_tokens(self) -> int:
        """Prompt plus the most it may generate."""
        return self.num_prompt_tokens + self.max_tokens


@dataclass(frozen=True)
class PoolLoad:
    """A pool's load as the gateway sees it, plus the static limits that bound it."""

    num_in_flight: int
    """Requests sent to the pool and not yet finished."""
    capacity: int
    """Requests the pool runs at once: max_num_seqs times live replicas."""
    max_queued: int
    """Requests allowed to wait beyond `capacity`."""
    max_request_tokens: int | None = None

    def has_headroom(self) -> bool:
        """A new request would start at once instead of waiting for a batch slot."""
        return self.num_in_flight < self.capacity

    def fits(self, features: RequestFeatures) -> bool:
        """Whether the request's tokens fit this pool's per-request limit."""
        limit = self.max_request_tokens
        return limit is None or features.num_total_tokens <= limit


def choose_pool(tier: Tier, features: RequestFeatures, loads: Mapping[str, PoolLoad]) -> str:
    """The tier's own pool while it has headroom and the request fits it, else its overflow.

    A tier without an overflow pool always stays on its own pool (and may
    queue there): interactive traffic never lands on the throughput pool.
    """
    primary = loads[tier.pool]
    if tier.overflow_pool is None or (primary.has_headroom() and primary.fits(features)):
        return tier.pool
    return tier.overflow_pool
