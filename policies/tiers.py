"""SLA tiers: what each promises, how a request picks one, and whether it was kept."""

from __future__ import annotations

from collections.abc import Collection
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

TPOT_HEADROOM = 0.9
"""The engine is asked for this share of a tier's TPOT: it keeps each step's predicted time
within its target, so a fit's error lands half the steps over it, and the stream to the
client adds its own hop (bench_sla measured overflowed interactive streams 5-10% over)."""


class Tier(BaseModel):
    """An SLA tier: its latency targets, its engine priority and where it runs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    ttft_ms: float = Field(gt=0)
    """Time-to-first-token target."""
    tpot_ms: float = Field(gt=0)
    """Time-per-output-token target, measured after the first token."""
    priority: int = 0
    """Engine scheduling priority: lower runs first (vLLM's convention)."""
    max_cost_per_1k_tokens: float | None = Field(default=None, gt=0)
    """The most this tier may cost per 1k output tokens: bench/serving/sweep.py picks the largest
    batch that meets the SLO within it."""
    pool: str
    """The pool this tier runs on while that pool has headroom."""
    overflow_pool: str | None = None
    """A second pool the tier may run on (the cheaper of the two that meets the SLO wins);
    None keeps it on `pool`."""
    on_slo_miss: Literal["protect", "downgrade", "queue"] = "queue"
    """When no pool is predicted to meet the SLO: `protect` runs it wherever its first token
    is in time (refused only when its own tier's demand is too much), `downgrade` runs it
    on `overflow_pool` without the SLO, `queue` waits on `pool` (policies/placement.py)."""
    keep_to_pool: bool = False
    """Prefer `pool` to a cheaper overflow pool while `pool` meets the SLO (set on the tier an
    easy request is placed with, so it runs on the small model while that keeps up)."""
    difficulty_routing: bool = False
    """Whether `model: auto` requests of this tier may go to the small model when the
    difficulty router finds them easy (policies/model_routing.py)."""
    deadline_s: float | None = Field(default=None, gt=0)
    """Longest a request of this tier may run, from arrival; past it the request is aborted
    and the client told (408, or an error event on a stream). None: only the app's
    request_timeout_s applies."""

    @property
    def tpot_target_s(self) -> float | None:
        """The time per token the engine is asked to keep for this tier's requests, with
        TPOT_HEADROOM: None for a tier that queues (batch) rather than being held to its TPOT."""
        return None if self.on_slo_miss == "queue" else TPOT_HEADROOM * self.tpot_ms / 1000


def resolve_tier(
    header: str | None,
    body: str | None,
    key_default: str | None,
    default: str,
    known: Collection[str],
) -> str:
    """The tier a request asked for: header, then body field, then its key's default.

    Raises ValueError for a tier that does not exist, so a typo is a 400
    instead of a silent downgrade.
    """
    tier = header or body or key_default or default
    if tier not in known:
        raise ValueError(f"unknown SLA tier {tier!r}; use one of {sorted(known)}")
    return tier


def meets_slo(tier: Tier, ttft_s: float, tpot_s: float | None) -> bool:
    """Whether one finished request met its tier's TTFT and TPOT targets.

    `tpot_s` is None for requests with a single output token: only TTFT applies.
    """
    if ttft_s * 1000 > tier.ttft_ms:
        return False
    return tpot_s is None or tpot_s * 1000 <= tier.tpot_ms
