"""What a step costs, learned online: seconds = base + per_seq * sequences + per_token * tokens
+ per_attended * attended positions.

The SLA control plane predicts time to first token and time per output token
from this fit (policies/latency.py), and the scheduler cuts prefill chunks to
time-per-token targets with it. Tokens carry the GEMM work (a prefill chunk
costs its length, a decode one token), sequences carry the per-request work
(sampling, preparation), attended positions the attention: each computed
token reads its whole context, so a chunk late in a long prompt costs more
than the same chunk early in it. Four numbers, so plain Python: no tensor
overhead on the step path.

The fit is least squares over past steps with forgetting (about the last 20
count), solved afresh from its decayed sums whenever it is read after a new
step, and needs no warm-up schedule: the prior is a plausible CPU step.
Recursive least squares, which updates the solution in place, did not survive
the load a pool really sees: decode steps at one batch size tie the base to
the per-sequence cost, a sequence's attended positions grow with its tokens,
and in bench_sla its covariance wound up until one step set the
per-sequence cost to 1.5 s, which the ingress then read for a whole poll.
Three things keep this fit sane:

- a ridge toward the prior, a ten-thousandth of each term's own weight in the
  sums, holds the terms the load does not tell apart where the prior put them;
- every term is at least 0 (more work never makes a step faster), by active
  set: a term that comes out negative is fixed at 0 and the others refitted,
  so the terms the ingress reads still add up to what the steps took;
- a step far off the fit (another process took its core) counts less:
  Huber's weight, beyond HUBER_K running mean errors.
"""

from __future__ import annotations

import time
from typing import NamedTuple

FORGETTING = 0.95
"""Weight kept by the past at each step: about the last 20 steps count (replayed steps of
bench_sla's pools were predicted better at 0.95 than at 0.98 or 0.99)."""
PRIOR_S = (0.02, 0.002, 0.0005, 0.0)
"""Base, per-sequence, per-token and per-thousand-attended-positions seconds before any
step was seen, and where the ridge holds the terms the load does not tell apart."""
RIDGE_SHARE = 1e-4
"""The prior's weight on each term, as a share of that term's weight in the sums."""
RIDGE_FLOOR = 1e-3
"""The prior's least weight: a term no step has exercised yet (attended positions while
no step read any) stays at the prior instead of making the sums singular."""
HUBER_K = 3.0
"""A step off the fit by more than this many running mean errors counts in proportion less."""
MIN_SPREAD_SHARE = 0.05
"""The running mean error is taken as at least this share of the predicted step: on a machine shared
with other processes steps vary by that much anyway, and a spread learned on cleaner
steps would otherwise weigh a real change of speed as an outlier for ever."""
WARM_UP_STEPS = 10
"""Steps that count in full while the running mean error is first learned."""
ATTENDED_UNIT = 1000
"""Attended positions are counted in thousands, so every feature is of a similar size."""

Vector = list[float]
Matrix = list[list[float]]


class StepWork(NamedTuple):
    """What one step computed, as the fit reads it (`SchedulerOutput.work` builds it)."""

    num_seqs: int
    num_tokens: int
    attended: int = 0
    """Context positions its tokens read (`SchedulerOutput.attended_positions`)."""
    prompt_tokens: int = 0
    """Of its tokens, those of prompt chunks."""
    prompt_attended: int = 0
    """Of its positions, those its prompt chunks read."""


class StepCostFit(NamedTuple):
    """What the engine reports of its step cost: a step takes base + per sequence in the
    batch + per token computed, in seconds. The ingress predicts latency from it
    (policies.pool_state.StepCost, which adds what serving measures apart)."""

    base_s: float = 0.0
    per_seq_s: float = 0.0
    per_token_s: float = 0.0
    """A token at the contexts recent steps' tokens read (mostly decodes, on a busy pool)."""
    per_prompt_token_s: float | None = None
    """A prompt token at the contexts recent prompt chunks read: less than a decode's on a
    pool of long streams (a chunk's tokens read only the prompt so far). Priced at
    `per_token_s`, the interactive pool's prompts under bench_sla's overload were predicted
    a fifth more steps than they took. None: not reported (`per_token_s` applies)."""


class StepCostModel:
    """Online least-squares fit of step time from (sequences, tokens, attended) observations."""

    def __init__(self) -> None:
        size = len(PRIOR_S)
        self._gram: Matrix = [[0.0] * size for _ in range(size)]
        """Decayed, weighted sum of each step's features times its features."""
        self._moment: Vector = [0.0] * size
        """Decayed, weighted sum of each step's features times its seconds."""
        self._theta: Vector = list(PRIOR_S)
        self._stale = False
        """Steps were observed since `_theta` was solved."""
        self._spread_s = 0.0
        """Running mean of how far steps were off the fit."""
        self._positions_per_token = _RecentMean()
        """Attended positions per computed token: the context a token reads today."""
        self._positions_per_prompt_token = _RecentMean()
        """The same, of prompt tokens alone."""
        self.num_observations = 0

    def observe(self, work: StepWork, seconds: float) -> None:
        """Fold in one measured step."""
        num_seqs, num_tokens, attended, prompt_tokens, prompt_attended = work
        x = [1.0, float(num_seqs), float(num_tokens), attended / ATTENDED_UNIT]
        predicted_s = _dot(x, self._fitted())
        weight = self._weight(predicted_s, seconds - predicted_s)
        self._gram = [
            [FORGETTING * g + weight * xi * xj for g, xj in zip(row, x, strict=True)]
            for row, xi in zip(self._gram, x, strict=True)
        ]
        self._moment = [
            FORGETTING * m + weight * xi * seconds for m, xi in zip(self._moment, x, strict=True)
        ]
        self._stale = True
        if num_tokens:
            self._positions_per_token.add(attended / num_tokens)
        if prompt_tokens:
            self._positions_per_prompt_token.add(prompt_attended / prompt_tokens)
        self.num_observations += 1

    def _weight(self, predicted_s: float, error_s: float) -> float:
        """Huber's weight of a step predicted to take `predicted_s` that took `error_s` more
        (or less), learning
        the running mean error on the way (each step's share of it clipped the same way)."""
        size_s = abs(error_s)
        if self.num_observations < WARM_UP_STEPS:
            self._spread_s += (size_s - self._spread_s) / (self.num_observations + 1)
            return 1.0
        bound_s = HUBER_K * max(self._spread_s, MIN_SPREAD_SHARE * predicted_s)
        self._spread_s += (1.0 - FORGETTING) * (min(size_s, bound_s) - self._spread_s)
        return 1.0 if size_s <= bound_s else bound_s / size_s

    def _fitted(self) -> Vector:
        """The fit to the steps so far, solved again only after new steps."""
        if self._stale:
            self._theta = self._non_negative_fit()
            self._stale = False
        return self._theta

    def _non_negative_fit(self) -> Vector:
        """The ridge fit with every term at least 0: the most negative term is fixed at 0
        and the others are fitted again, until none is negative."""
        free = list(range(len(PRIOR_S)))
        while free:
            theta = self._ridge_fit(free)
            negative = [i for i in free if theta[i] < 0]
            if not negative:
                return theta
            free.remove(min(negative, key=theta.__getitem__))
        return [0.0] * len(PRIOR_S)

    def _ridge_fit(self, free: list[int]) -> Vector:
        """Least squares over the terms in `free` (the others at 0), each held toward the
        prior by RIDGE_SHARE of its own weight."""
        ridge = [RIDGE_SHARE * self._gram[i][i] + RIDGE_FLOOR for i in free]
        matrix = [
            [self._gram[i][j] + (r if i == j else 0.0) for j in free]
            for i, r in zip(free, ridge, strict=True)
        ]
        rhs = [self._moment[i] + r * PRIOR_S[i] for i, r in zip(free, ridge, strict=True)]
        theta = [0.0] * len(PRIOR_S)
        for i, value in zip(free, _solve(matrix, rhs), strict=True):
            theta[i] = value
        return theta

    def step_s(self, num_seqs: int, num_tokens: int, attended: int) -> float:
        """Predicted seconds of a step."""
        base, per_seq, per_token, per_thousand = self._fitted()
        attention_s = per_thousand * attended / ATTENDED_UNIT
        return base + per_seq * num_seqs + per_token * num_tokens + attention_s

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
        _, _, per_token, per_thousand = self._fitted()
        return per_token + per_thousand * context / ATTENDED_UNIT

    def coefficients(self) -> StepCostFit:
        """The fit as the engine reports it. A token's attention at the contexts of recent
        steps is folded into its cost, and a prompt token's at those of recent prompt
        chunks into its own, for predictions that know no context (policies/latency.py)."""
        base, per_seq, _, _ = self._fitted()
        return StepCostFit(
            base, per_seq,
            self.token_s(round(self._positions_per_token.value)),
            self.token_s(round(self._positions_per_prompt_token.value)),
        )  # fmt: skip


class StepClock:
    """When a step's cost starts counting: from the end of the step before when the engine
    had work left then, else from the step's own start. What the loop does between steps
    delays the next token as much as the forward pass does (19 ms a step on the offline
    pool under bench_sla's overload), so a busy engine's steps are priced end to end."""

    def __init__(self) -> None:
        self._busy_since_s: float | None = None
        """When the last step ended, if work was left then."""

    def start(self) -> float:
        """The step's starting time."""
        return self._busy_since_s or time.perf_counter()

    def stop(self, work_left: bool) -> float:
        """The step's ending time; the next step counts from it when `work_left`."""
        ended_s = time.perf_counter()
        self._busy_since_s = ended_s if work_left else None
        return ended_s


class _RecentMean:
    """A mean that forgets at FORGETTING a step, starting at its first value."""

    def __init__(self) -> None:
        self.value = 0.0
        self._seen = False

    def add(self, value: float) -> None:
        """Move the mean toward `value` (to it, the first time)."""
        share = 1.0 - FORGETTING if self._seen else 1.0
        self.value += share * (value - self.value)
        self._seen = True


def _dot(a: Vector, b: Vector) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def _solve(matrix: Matrix, rhs: Vector) -> Vector:
    """x with matrix @ x = rhs: Gaussian elimination with partial pivoting (at most 4 x 4,
    kept positive definite by the ridge)."""
    size = len(rhs)
    rows = [row[:] + [value] for row, value in zip(matrix, rhs, strict=True)]
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(rows[r][col]))
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(col + 1, size):
            factor = rows[r][col] / rows[col][col]
            rows[r] = [a - factor * b for a, b in zip(rows[r], rows[col], strict=True)]
    solution = [0.0] * size
    for r in reversed(range(size)):
        known = sum(rows[r][k] * solution[k] for k in range(r + 1, size))
        solution[r] = (rows[r][size] - known) / rows[r][r]
    return solution
