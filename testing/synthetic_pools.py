"""Synthetic pools and tiers for the policy tests: a pool's step cost and what it has in
flight, built in a line, so a test states only what it varies."""

from __future__ import annotations

from collections.abc import Iterable

from policies.pool_state import InFlightSequence, PoolState, StepCost
from policies.tiers import Tier

COST = StepCost(base_s=0.010, per_seq_s=0.001, per_token_s=0.0005)
INTERACTIVE = Tier(
    name="interactive", ttft_ms=400, tpot_ms=25, priority=0, pool="fast",
    overflow_pool="bulk", on_slo_miss="protect",
)  # fmt: skip
STANDARD = Tier(
    name="standard", ttft_ms=2000, tpot_ms=60, priority=1, pool="fast",
    overflow_pool="bulk", on_slo_miss="downgrade",
)  # fmt: skip
BATCH = Tier(name="batch", ttft_ms=60_000, tpot_ms=500, priority=2, pool="bulk")


def pool(
    name: str, in_flight: Iterable[InFlightSequence] = (), max_num_seqs: int = 4,
    replicas: int = 1, max_queued: int = 4, price: float = 1.0,
) -> PoolState:  # fmt: skip
    """A pool of COST with `in_flight` sequences and a 256-token step budget."""
    return PoolState(
        name=name, num_replicas=replicas, max_num_seqs=max_num_seqs, max_num_batched_tokens=256,
        cost=COST, in_flight=tuple(in_flight), max_queued=max_queued, cost_per_1k_tokens=price,
    )  # fmt: skip


def decoding(priority: int, n: int, remaining: int = 50) -> list[InFlightSequence]:
    """`n` sequences of `priority` with 100-token prompts, decoding `remaining` more tokens."""
    return [InFlightSequence(priority, 100, remaining, prefilled=True) for _ in range(n)]
