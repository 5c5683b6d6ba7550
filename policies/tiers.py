"""SLA tiers: what each promises, how a request picks one, and whether it was kept."""

from __future__ import annotations

from collections.abc import Collection

from pydantic import BaseModel, ConfigDict, Field


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
    pool: str
    """The pool this tier runs on while that pool has headroom."""
    overflow_pool: str | None = None
    """Where the tier goes when `pool` is full; None keeps it on `pool`."""
    shed_at_queue_fraction: float = Field(default=1.0, gt=0, le=1)
    """Shed with 429 once a pool's queue reaches this fraction of its limit:
    lower tiers get smaller fractions so they are shed first."""


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
