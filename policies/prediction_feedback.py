"""Predictions corrected by what was measured: a factor per pool, priority and metric, learned
online.

The latency model (policies/latency.py) sees what a pool reports: its queue, its
batch, its step-cost fit. It does not see what lies outside the engine: other
pools' engines on the same cores, queueing in Serve's proxy and in the ingress,
the stream's way back. Under overload that was most of a TTFT (`bench_sla
--quick`: TTFT error p50 1.08 s against a 400 ms SLO, 3.0 s on the offline pool).

Every finished request's measured TTFT and TPOT, against what placement predicted
for it, move the factor of its pool and priority for that metric:

    log f  <-  log f + RATE * log(measured / predicted)

Predictions are already multiplied by f, so the update stops where the corrected
predictions are right on (geometric) average, and follows the load as it changes.
A multiplicative factor fits the errors seen: they grow with the load the model
undercounts. Each step is clipped, so one stalled request cannot throw it far.
Priorities learn apart: on one pool a batch request's TTFT is mostly its wait
behind the queue, an interactive one's (served first) is not, and a factor
learned from the first made every interactive overflow look late (bench_sla
--quick with one factor per pool: 58 interactive requests shed while batch work
ran, against 0 without correction).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

METRICS = ("ttft", "tpot")
RATE = 0.1
"""How far one request moves the factor: about the last 10 requests count."""
MAX_STEP = math.log(2.0)
"""One request moves the factor by at most 2x either way."""
FACTOR_RANGE = (0.25, 16.0)
"""The model is never trusted less than this: a factor stays within it."""


@dataclass(frozen=True)
class Correction:
    """What to multiply a pool's predictions for one priority by."""

    ttft: float = 1.0
    tpot: float = 1.0


@dataclass
class PredictionFeedback:
    """Correction factors by pool, priority and metric (1.0 until requests teach one)."""

    _log_factors: dict[tuple[str, int, str], float] = field(default_factory=dict)

    def corrections(self, pool: str) -> Mapping[int, Correction]:
        """`pool`'s corrections by priority (a priority not listed: none)."""
        learnt = {priority for name, priority, _ in self._log_factors if name == pool}
        return {priority: self._correction(pool, priority) for priority in learnt}

    def learn(
        self, pool: str, priority: int, metric: str, predicted_s: float, measured_s: float
    ) -> None:
        """One request's measured value against the (corrected) prediction it was placed on."""
        if metric not in METRICS:
            raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
        if predicted_s <= 0.0 or measured_s <= 0.0:
            return  # nothing to learn from a zero (a cached answer, a one-token reply)
        step = max(-MAX_STEP, min(MAX_STEP, math.log(measured_s / predicted_s)))
        low, high = (math.log(bound) for bound in FACTOR_RANGE)
        current = self._log_factors.get((pool, priority, metric), 0.0)
        self._log_factors[pool, priority, metric] = max(low, min(high, current + RATE * step))

    def _correction(self, pool: str, priority: int) -> Correction:
        ttft, tpot = (self._log_factors.get((pool, priority, m), 0.0) for m in METRICS)
        return Correction(ttft=math.exp(ttft), tpot=math.exp(tpot))
