"""Predictions corrected by what was measured: a factor per pool and metric, learned online.

The latency model (policies/latency.py) sees what a pool reports: its queue, its
batch, its step-cost fit. It does not see what lies outside the engine: other
pools' engines on the same cores, queueing in Serve's proxy and in the ingress,
the stream's way back. Under overload that was most of a TTFT (`bench_sla
--quick`: TTFT error p50 1.08 s against a 400 ms SLO, 3.0 s on the offline pool).

Every finished request's measured TTFT and TPOT, against what placement predicted
for it, move its pool's factor for that metric:

    log f  <-  log f + RATE * log(measured / predicted)

Predictions are already multiplied by f, so the update stops where the corrected
predictions are right on (geometric) average, and follows the load as it changes.
A multiplicative factor fits the errors seen: they grow with the load the model
undercounts. Each step is clipped, so one stalled request cannot throw it far.
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


@dataclass
class PredictionFeedback:
    """Correction factors by pool and metric (1.0 until a pool's requests teach one)."""

    _log_factors: dict[tuple[str, str], float] = field(default_factory=dict)

    def factor(self, pool: str, metric: str) -> float:
        """What to multiply the model's prediction of `metric` on `pool` by."""
        return math.exp(self._log_factors.get((pool, metric), 0.0))

    def factors(self, pool: str) -> Mapping[str, float]:
        """Every metric's factor for `pool`."""
        return {metric: self.factor(pool, metric) for metric in METRICS}

    def learn(self, pool: str, metric: str, predicted_s: float, measured_s: float) -> None:
        """One request's measured value against the (corrected) prediction it was placed on."""
        if metric not in METRICS:
            raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
        if predicted_s <= 0.0 or measured_s <= 0.0:
            return  # nothing to learn from a zero (a cached answer, a one-token reply)
        step = max(-MAX_STEP, min(MAX_STEP, math.log(measured_s / predicted_s)))
        low, high = (math.log(bound) for bound in FACTOR_RANGE)
        current = self._log_factors.get((pool, metric), 0.0)
        self._log_factors[pool, metric] = max(low, min(high, current + RATE * step))
