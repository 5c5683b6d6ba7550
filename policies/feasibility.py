"""Whether each tier's SLO is within what its pools can do on this hardware, idle.

A tier whose targets its pools miss even with nothing else running gets 0%
goodput whatever placement does (configs/local.yaml's 25 ms TPOT against a
batch-1 step of 45-70 ms on a 2-core VM, issue 28). Said at start and whenever
the fitted step costs change, instead of being found in the goodput: the
best idle TTFT (a TYPICAL_PROMPT_TOKENS prompt) and idle TPOT over the tier's
pool and overflow pool, from the same latency model placement uses
(policies/latency.py) on an empty pool.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from policies.latency import predict
from policies.pool_state import PoolState
from policies.tiers import Tier

TYPICAL_PROMPT_TOKENS = 200
"""A chat prompt's median length in tokens (bench/traffic/workloads.py's chat shape)."""


@dataclass(frozen=True)
class Feasibility:
    """A tier's SLO against the best its pools do idle (None: no pool has a fitted cost)."""

    tier: str
    ttft_ms: float
    tpot_ms: float
    idle_ttft_ms: float | None
    idle_tpot_ms: float | None

    @property
    def known(self) -> bool:
        """Some pool of the tier has reported a fitted step cost."""
        return self.idle_ttft_ms is not None and self.idle_tpot_ms is not None

    @property
    def feasible(self) -> bool:
        """Both targets met idle (unknown counts as feasible: nothing says otherwise)."""
        if self.idle_ttft_ms is None or self.idle_tpot_ms is None:
            return True
        return self.idle_ttft_ms <= self.ttft_ms and self.idle_tpot_ms <= self.tpot_ms

    def describe(self) -> str:
        """One line for the log and /health: the targets and what the hardware gives."""
        return (
            f"tier {self.tier}: SLO TTFT {self.ttft_ms:.0f} ms / TPOT {self.tpot_ms:.0f} ms, "
            f"its pools give at best {self.idle_ttft_ms:.0f} ms / {self.idle_tpot_ms:.1f} ms "
            f"idle ({TYPICAL_PROMPT_TOKENS}-token prompt)"
        )


def idle_latency_ms(pool: PoolState, tier: Tier) -> tuple[float, float] | None:
    """TTFT and TPOT (ms) of a typical request of `tier` on `pool` with nothing in flight;
    None before the pool has a fitted step cost."""
    if pool.cost.step_s(1, 1) <= 0:
        return None
    prediction = predict(pool.idle(), tier.priority, TYPICAL_PROMPT_TOKENS, tier.tpot_target_s)
    return prediction.ttft_s * 1000, prediction.tpot_s * 1000


def check_tier(tier: Tier, pools: Mapping[str, PoolState]) -> Feasibility:
    """The tier's SLO against the best of its pool and overflow pool, idle."""
    names = [name for name in (tier.pool, tier.overflow_pool) if name in pools]
    idle = [latency for name in names if (latency := idle_latency_ms(pools[name], tier))]
    best = min(idle, key=lambda latency: _over_slo(latency, tier), default=None)
    return Feasibility(tier.name, tier.ttft_ms, tier.tpot_ms, *(best if best else (None, None)))


def check_tiers(tiers: Iterable[Tier], pools: Mapping[str, PoolState]) -> list[Feasibility]:
    """Every tier's feasibility."""
    return [check_tier(tier, pools) for tier in tiers]


def _over_slo(latency: tuple[float, float], tier: Tier) -> float:
    """How far past its targets a pool is, as the larger of the two ratios (lower is better)."""
    return max(latency[0] / tier.ttft_ms, latency[1] / tier.tpot_ms)
