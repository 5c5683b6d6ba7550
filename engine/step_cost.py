"""What a step costs, learned online: seconds = base + per_seq * sequences + per_token * tokens
+ per_attended * attended positions.

The SLA control plane predicts time to first token and time per output token
from this fit (policies/latency.py), and the scheduler cuts prefill chunks to
time-per-token targets with it. Tokens carry the GEMM work (a prefill chunk
costs its length, a decode one token), sequences carry the per-request work
(sampling, preparation), attended positions the attention: each computed
token reads its whole context, so a chunk late in a long prompt costs more
than the same chunk early in it. Recursive least squares with a forgetting
factor follows the machine as load and context lengths drift, and needs no
warm-up schedule: the prior is a plausible CPU step. Four numbers, so plain
Python: no tensor overhead on the step path.
"""

from __future__ import annotations

from typing import NamedTuple

FORGETTING = 0.98
"""Weight kept by the past at each step: about the last 50 steps count."""
PRIOR_S = (0.02, 0.002, 0.0005, 0.0)
"""Base, per-sequence, per-token and per-thousand-attended-positions seconds before any
step was seen."""
PRIOR_VARIANCE = 1e3
"""Large: the first real steps override the prior quickly."""
ATTENDED_UNIT = 1000
"""Attended positions are counted in thousands, so every feature is of a similar size."""

Vector = list[float]
Matrix = list[list[float]]


class StepCostFit(NamedTuple):
    """What the engine reports of its step cost: a step takes base + per sequence in the
    batch + per token computed, in seconds. The ingress predicts latency from it
    (policies.latency.StepCost, which adds what serving measures apart)."""

    base_s: float = 0.0
    per_seq_s: float = 0.0
    per_token_s: float = 0.0


class StepCostModel:
    """Online least-squares fit of step time from (sequences, tokens, attended) observations."""

    def __init__(self) -> None:
        size = len(PRIOR_S)
        self._theta: Vector = list(PRIOR_S)
        self._p: Matrix = [
            [PRIOR_VARIANCE if i == j else 0.0 for j in range(size)] for i in range(size)
        ]
        self._positions_per_token = 0.0
        """Recent attended positions per computed token: the context a token reads today."""
        self.num_observations = 0

    def observe(self, num_seqs: int, num_tokens: int, seconds: float, attended: int = 0) -> None:
        """Fold in one measured step (recursive least squares with forgetting)."""
        x = [1.0, float(num_seqs), float(num_tokens), attended / ATTENDED_UNIT]
        px = [_dot(row, x) for row in self._p]
        gain = [v / (FORGETTING + _dot(x, px)) for v in px]
        error = seconds - _dot(x, self._theta)
        self._theta = [t + g * error for t, g in zip(self._theta, gain, strict=True)]
        # Forget only while the covariance is bounded: in directions the load never
        # explores (decode-only steps tie sequences to tokens) it would grow without end.
        size = len(x)
        bounded = max(self._p[i][i] for i in range(size)) < PRIOR_VARIANCE
        forget = FORGETTING if bounded else 1.0
        self._p = [
            [(self._p[i][j] - gain[i] * px[j]) / forget for j in range(size)] for i in range(size)
        ]
        if num_tokens:
            recent = attended / num_tokens
            weight = 1.0 - FORGETTING if self.num_observations else 1.0
            self._positions_per_token += weight * (recent - self._positions_per_token)
        self.num_observations += 1

    def step_s(self, num_seqs: int, num_tokens: int, attended: int) -> float:
        """Predicted seconds of a step."""
        base, per_seq, per_token, per_attended = self._non_negative()
        return base + per_seq * num_seqs + per_token * num_tokens + per_attended * attended

    def tokens_within(
        self, limit_s: float, num_seqs: int, num_tokens: int, attended: int, context: int
    ) -> int:
        """How many more prompt tokens, each reading about `context` positions, a step of
        `num_seqs` sequences already computing `num_tokens` tokens over `attended` positions
        can take and still be predicted to last at most `limit_s` (0 when none)."""
        spare_s = limit_s - self.step_s(num_seqs, num_tokens, attended)
        if spare_s <= 0:
            return 0
        return self.tokens_in(spare_s, context)

    def tokens_in(self, seconds: float, context: int) -> int:
        """Prompt tokens, each reading about `context` positions, predicted to cost `seconds`."""
        per_new_token = self.token_s(context)
        return int(seconds / per_new_token) if per_new_token > 0 else 2**31

    def token_s(self, context: int) -> float:
        """Predicted seconds one more token reading `context` positions adds to a step."""
        _, _, per_token, per_attended = self._non_negative()
        return per_token + per_attended * context

    def coefficients(self) -> StepCostFit:
        """The fit as the engine reports it, each term kept non-negative: more work never
        makes a step faster. A token's attention at the contexts of recent steps is folded
        into its cost, for predictions that know no context (policies/latency.py)."""
        base, per_seq, per_token, per_attended = self._non_negative()
        return StepCostFit(base, per_seq, per_token + per_attended * self._positions_per_token)

    def _non_negative(self) -> tuple[float, float, float, float]:
        """The fit with attended positions counted one by one, each term at least 0."""
        base, per_seq, per_token, per_thousand = (max(0.0, v) for v in self._theta)
        return base, per_seq, per_token, per_thousand / ATTENDED_UNIT


def _dot(a: Vector, b: Vector) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))
