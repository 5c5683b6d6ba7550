"""What a step costs, learned online: seconds = base + per_seq * sequences + per_token * tokens.

The SLA control plane predicts time to first token and time per output token
from this fit (policies/latency.py): tokens carry the GEMM work (a prefill
chunk costs its length, a decode one token), sequences carry the per-request
work (attention over the context, sampling). Recursive least squares with a
forgetting factor follows the machine as load and context lengths drift, and
needs no warm-up schedule: the prior is a plausible CPU step. Three numbers,
so plain Python: no tensor overhead on the step path.
"""

from __future__ import annotations

FORGETTING = 0.98
"""Weight kept by the past at each step: about the last 50 steps count."""
PRIOR_S = (0.02, 0.002, 0.0005)
"""Base, per-sequence and per-token seconds before any step was seen."""
PRIOR_VARIANCE = 1e3
"""Large: the first real steps override the prior quickly."""

Vector = list[float]
Matrix = list[list[float]]


class StepCostModel:
    """Online least-squares fit of step time from (sequences, tokens) observations."""

    def __init__(self) -> None:
        self._theta: Vector = list(PRIOR_S)
        self._p: Matrix = [[PRIOR_VARIANCE if i == j else 0.0 for j in range(3)] for i in range(3)]
        self.num_observations = 0

    def observe(self, num_seqs: int, num_tokens: int, seconds: float) -> None:
        """Fold in one measured step (recursive least squares with forgetting)."""
        x = [1.0, float(num_seqs), float(num_tokens)]
        px = [_dot(row, x) for row in self._p]
        gain = [v / (FORGETTING + _dot(x, px)) for v in px]
        error = seconds - _dot(x, self._theta)
        self._theta = [t + g * error for t, g in zip(self._theta, gain, strict=True)]
        # Forget only while the covariance is bounded: in directions the load never
        # explores (decode-only steps tie sequences to tokens) it would grow without end.
        forget = FORGETTING if max(self._p[i][i] for i in range(3)) < PRIOR_VARIANCE else 1.0
        self._p = [[(self._p[i][j] - gain[i] * px[j]) / forget for j in range(3)] for i in range(3)]
        self.num_observations += 1

    def tokens_within(self, limit_s: float, num_seqs: int, num_tokens: int) -> int:
        """How many more tokens a step of `num_seqs` sequences already computing `num_tokens`
        can take and still be predicted to last at most `limit_s` (0 when none)."""
        base, per_seq, per_token = self.coefficients()
        spare_s = limit_s - (base + per_seq * num_seqs + per_token * num_tokens)
        if spare_s <= 0:
            return 0
        return int(spare_s / per_token) if per_token > 0 else 2**31

    def coefficients(self) -> tuple[float, float, float]:
        """(base, per-sequence, per-token) seconds, each kept non-negative: more work
        never makes a step faster."""
        base, per_seq, per_token = (max(0.0, v) for v in self._theta)
        return base, per_seq, per_token


def _dot(a: Vector, b: Vector) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))
