"""Each tier's SLO checked against its pools' live step-cost fits (policies/feasibility.py).

The ingress checks at start and every WATCH_PERIOD_S after (the fits move as
the engines learn and as load on shared cores changes); a tier turning
infeasible is a warning in the log (and its return an info line), a line in
/health's details, and `tierserve:slo_feasible{tier}` 0 beside the idle TTFT
and TPOT its pools give.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Sequence

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from policies.feasibility import Feasibility, check_tiers
from policies.tiers import Tier
from serving.pools.pool_monitor import PoolMonitor

log = logging.getLogger(__name__)

WATCH_PERIOD_S = 30.0
"""How often the fits are re-checked: a fit moves over tens of steps, not per poll."""


class SloWatch(Collector):
    """The latest feasibility of every tier, logged when it changes, exported as metrics."""

    def __init__(self, tiers: Sequence[Tier], monitor: PoolMonitor) -> None:
        self._tiers = tuple(tiers)
        self._monitor = monitor
        self._feasible: dict[str, bool] = {}

    def check(self) -> list[Feasibility]:
        """Every tier against its pools now; logs each tier whose verdict changed."""
        results = check_tiers(self._tiers, self._monitor.states())
        for result in results:
            if result.known and self._feasible.get(result.tier) != result.feasible:
                if result.feasible:
                    log.info("SLO feasible again: %s", result.describe())
                else:
                    log.warning("SLO infeasible on this hardware: %s", result.describe())
                self._feasible[result.tier] = result.feasible
        return results

    def infeasible(self) -> dict[str, str]:
        """Tiers whose SLO their pools miss even idle, with why (for /health's details)."""
        return {r.tier: r.describe() for r in self.check() if not r.feasible}

    async def watch_forever(self) -> None:
        """Re-check every WATCH_PERIOD_S for the life of the ingress."""
        while True:
            await asyncio.sleep(WATCH_PERIOD_S)
            self.check()

    def collect(self) -> Iterator[Metric]:
        """`tierserve:slo_feasible` and the idle latencies behind it, per tier with a fit."""
        known = [r for r in self.check() if r.known]
        feasible = GaugeMetricFamily(
            "tierserve:slo_feasible", "1 when a tier's pools meet its SLO idle, else 0.",
            labels=["tier"],
        )  # fmt: skip
        idle = GaugeMetricFamily(
            "tierserve:slo_idle_latency_ms",
            "Best idle TTFT and TPOT of a tier's pools (typical prompt).",
            labels=["tier", "kind"],
        )
        for result in known:
            feasible.add_metric([result.tier], float(result.feasible))
            idle.add_metric([result.tier, "ttft"], result.idle_ttft_ms or 0.0)
            idle.add_metric([result.tier, "tpot"], result.idle_tpot_ms or 0.0)
        yield feasible
        yield idle
