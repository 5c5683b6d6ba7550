"""Admission and routing on predicted latency: where a request runs, or why it is refused.

Each request goes to the cheapest of its tier's pools predicted to meet the
tier's TTFT and TPOT targets (policies/latency.py); a `protect` tier prefers
its own (latency-tuned) pool while that meets them. When none is, the tier's
`on_slo_miss` decides:

- `protect` (interactive): run wherever the first token is predicted in time,
  even if the pool is busy with other tiers' work (the engine schedules the
  request ahead of them, preempting, and keeps its time per token); refuse
  only when this tier's own demand is more than the deployment can serve in
  time. Any pool, its own included, takes the tier only at a time per token
  (less urgent work held back to the target) within the TPOT; where the
  hardware is below the SLO (its own pool misses it even idle), at one no
  worse than its own pool would give it: a slower pool is no refuge, an
  equally slow one is. A prompt too long for the TTFT even
  on an idle pool is in time if it waits no longer than it computes: at most
  twice its idle TTFT.
- `downgrade` (standard): run on the overflow pool without the SLO, and say so.
- `queue` (batch): wait on its pool.

Queue limits count only the work that would wait ahead of the request, that
is, of equal or more urgent priority. A full queue therefore turns away the
least urgent tier first, and an interactive request is never refused because
batch work is queued. A refusal carries a Retry-After from the predicted time
for the queue to drain, jittered so that refused clients do not return in step.

Batch is shed first (`ShedFirst`): while a `protect` tier is being refused for
want of time, the tiers that queue on its pools are refused too (`shed_for_urgent`)
until its Retry-After has passed, so that no new batch work takes the capacity
the urgent tier is short of.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from policies.latency import Prediction, drain_s, predict
from policies.pool_state import PoolState
from policies.tiers import Tier

MIN_RETRY_AFTER_S = 1
UNAVAILABLE_RETRY_AFTER_S = 5
"""Retry-After when none of the tier's pools has a live replica: Serve is replacing one."""
JITTER = 0.5
"""Retry-After is stretched by up to this fraction, at random."""


@dataclass(frozen=True)
class Placement:
    """The decision for one request: a pool and why, or a refusal and when to retry."""

    pool: str | None
    """None: refused (429)."""
    reason: str
    """`slo` (predicted within its SLO), `overflow` (first token in time on a busy pool),
    `downgrade`, `queue`; refusals: `shed_queue_full`, `shed_slo`, `shed_for_urgent`
    (`ShedFirst`), and `unavailable` (no pool of the tier has a live replica: a 503,
    not a 429)."""
    prediction: Prediction | None = None
    retry_after_s: int | None = None
    candidates: Mapping[str, Prediction] = field(default_factory=dict)
    """What every pool the tier may use was predicted to give the request (the request log
    shows them: why a pool was passed over)."""

    @property
    def downgraded(self) -> bool:
        """Runs without its tier's SLO (the response says so)."""
        return self.reason == "downgrade"


@dataclass(frozen=True)
class RequestShape:
    """What placement knows of a request before it runs."""

    num_prompt_tokens: int
    """Of its longest prompt."""
    max_tokens: int
    num_sequences: int = 1
    """Prompts times `n`: each is a sequence in the engine."""
    constrained: bool = False
    """Held to a grammar (structured output, a forced tool call): each token pays a mask."""


def place(
    tier: Tier, shape: RequestShape, pools: Mapping[str, PoolState], jitter: float = 0.0
) -> Placement:
    """Choose a pool for a request of `tier`; `jitter` in [0, 1) spreads Retry-After."""
    candidates = _candidates(tier, shape, pools)
    if not candidates:
        return Placement(None, "unavailable", retry_after_s=UNAVAILABLE_RETRY_AFTER_S)
    predictions = {
        name: predict(
            pools[name],
            tier.priority,
            shape.num_prompt_tokens,
            tier.tpot_target_s,
            shape.constrained,
        )
        for name in candidates
    }
    return replace(_choose(tier, shape, pools, predictions, jitter), candidates=predictions)


def _choose(
    tier: Tier,
    shape: RequestShape,
    pools: Mapping[str, PoolState],
    predictions: Mapping[str, Prediction],
    jitter: float,
) -> Placement:
    open_pools = {
        n: p for n, p in predictions.items() if _queue_ahead(pools[n], p, shape.num_sequences) == 0
    }
    in_slo = [n for n, p in open_pools.items() if _meets(tier, p)]
    if in_slo:
        best = min(in_slo, key=lambda n: _preference(tier, n, pools[n]))
        return Placement(best, "slo", predictions[best])
    if tier.on_slo_miss == "protect":
        return _protect(tier, shape, pools, predictions, open_pools, jitter)
    target = (
        tier.overflow_pool if tier.on_slo_miss == "downgrade" and tier.overflow_pool else tier.pool
    )
    if target not in predictions:  # too large for it: the candidate that takes it
        target = next(iter(predictions))
    if target in open_pools and tier.on_slo_miss == "downgrade":  # it runs without a target
        pool = pools[target]
        untargeted = predict(pool, tier.priority, shape.num_prompt_tokens, None, shape.constrained)
        return Placement(target, "downgrade", untargeted)
    if target in open_pools:
        return Placement(target, "queue", predictions[target])
    pool, prediction = pools[target], predictions[target]
    wait_s = drain_s(pool, _queue_ahead(pool, prediction, shape.num_sequences))
    return _refuse(prediction, "shed_queue_full", wait_s, jitter)


def _protect(
    tier: Tier,
    shape: RequestShape,
    pools: Mapping[str, PoolState],
    predictions: Mapping[str, Prediction],
    open_pools: Mapping[str, Prediction],
    jitter: float,
) -> Placement:
    """First token in time wherever possible; else refused, with the soonest pool's drain."""
    tpot_limit_ms = _tpot_limit_ms(tier, shape, pools, predictions)
    in_time = [
        n
        for n, p in open_pools.items()
        if p.ttft_s * 1000 <= _ttft_limit_ms(tier, shape, pools[n])
        and p.tpot_s * 1000 <= tpot_limit_ms
    ]
    if in_time:
        best = min(in_time, key=lambda n: (n != tier.pool, predictions[n].ttft_s))
        reason = "slo" if _meets(tier, predictions[best]) else "overflow"
        return Placement(best, reason, predictions[best])
    soonest = min(predictions, key=lambda n: predictions[n].ttft_s)
    prediction = predictions[soonest]
    pool = pools[soonest]
    # Until this tier's own backlog has drained enough for a first token in time.
    backlog = drain_s(pool, _queue_ahead(pool, prediction, shape.num_sequences))
    wait_s = max(prediction.ttft_s - _ttft_limit_ms(tier, shape, pool) / 1000, backlog)
    return _refuse(prediction, "shed_slo", wait_s, jitter)


def _refuse(prediction: Prediction | None, reason: str, wait_s: float, jitter: float) -> Placement:
    retry_after_s = max(MIN_RETRY_AFTER_S, math.ceil(wait_s * (1 + JITTER * jitter)))
    return Placement(None, reason, prediction, retry_after_s)


def _preference(tier: Tier, name: str, pool: PoolState) -> tuple[bool, float]:
    """Cheapest first; a `protect` tier keeps to its own pool while that meets the SLO (its
    pool is configured for latency: small batches, speculation), as does a tier that asks to
    (`keep_to_pool`: an easy request on the small model)."""
    away = (tier.on_slo_miss == "protect" or tier.keep_to_pool) and name != tier.pool
    return away, pool.cost_per_1k_tokens


def _candidates(tier: Tier, shape: RequestShape, pools: Mapping[str, PoolState]) -> list[str]:
    """The tier's pools with a live replica, own pool first, without those whose
    `max_request_tokens` the request exceeds (unless that leaves none: the limit is a
    preference, not a refusal). A pool with no replica (its node lost) predicts no wait
    at all; it must not attract the traffic it cannot serve."""
    overflow = [tier.overflow_pool] if tier.overflow_pool not in (None, tier.pool) else []
    names = [n for n in (tier.pool, *overflow) if pools[n].num_replicas > 0]
    total = shape.num_prompt_tokens + shape.max_tokens
    fitting = [n for n in names if total <= (pools[n].max_request_tokens or math.inf)]
    return fitting or names


def _queue_ahead(pool: PoolState, prediction: Prediction, num_sequences: int = 1) -> int:
    """How far past the queue limit the request's sequences would wait (0: within it)."""
    waiting = max(0, prediction.num_ahead + num_sequences - pool.num_slots)
    return max(0, waiting - pool.max_queued)


def _ttft_limit_ms(tier: Tier, shape: RequestShape, pool: PoolState) -> float:
    """The tier's TTFT, or twice the prompt's TTFT on the idle pool when that is longer."""
    idle = predict(pool.idle(), tier.priority, shape.num_prompt_tokens)
    return max(tier.ttft_ms, 2 * idle.ttft_s * 1000)


def _tpot_limit_ms(
    tier: Tier, shape: RequestShape, pools: Mapping[str, PoolState],
    predictions: Mapping[str, Prediction],
) -> float:  # fmt: skip
    """The time per token a `protect` request may be placed at: its tier's target where its
    own pool (the best candidate, when its own cannot take it) meets that idle; where even
    the idle pool does not (the hardware is below the SLO), what its own pool gives it now,
    so that overflow makes it no worse. While a request was exempt from the target at home
    whatever the load there, bench_sla's interactive pool took streams at 41 ms a token
    against a 35 ms SLO it meets at 15 ms idle, and most of them missed it."""
    home = (
        tier.pool
        if tier.pool in predictions
        else min(predictions, key=lambda n: predictions[n].tpot_s)
    )
    idle = predict(pools[home].idle(), tier.priority, shape.num_prompt_tokens, tier.tpot_target_s)
    if idle.tpot_s * 1000 <= tier.tpot_ms:
        return tier.tpot_ms
    return max(tier.tpot_ms, predictions[home].tpot_s * 1000)


def _meets(tier: Tier, prediction: Prediction) -> bool:
    return prediction.ttft_s * 1000 <= tier.ttft_ms and prediction.tpot_s * 1000 <= tier.tpot_ms


@dataclass
class ShedFirst:
    """Batch is shed first: the pools a `protect` tier is being refused on, and until when;
    requests of the tiers that queue there are refused meanwhile. One per ingress replica
    (each sees its own refusals: a replica that refuses nothing holds nothing back)."""

    until_s: dict[str, float] = field(default_factory=dict)
    """Pool name: the monotonic time its hold ends."""

    def note(self, tier: Tier, placement: Placement, now_s: float) -> None:
        """Hold the tier's pools for a `protect` tier's `shed_slo` Retry-After."""
        if tier.on_slo_miss != "protect" or placement.reason != "shed_slo":
            return
        until_s = now_s + (placement.retry_after_s or MIN_RETRY_AFTER_S)
        for pool in filter(None, (tier.pool, tier.overflow_pool)):
            self.until_s[pool] = max(self.until_s.get(pool, 0.0), until_s)

    def refusal(self, tier: Tier, now_s: float) -> Placement | None:
        """The `shed_for_urgent` refusal of a request of `tier` while its pool is held (a
        tier that queues), with the rest of the hold as its Retry-After; None otherwise."""
        left_s = self.until_s.get(tier.pool, 0.0) - now_s
        if tier.on_slo_miss != "queue" or left_s <= 0:
            return None
        return _refuse(None, "shed_for_urgent", left_s, jitter=0.0)
