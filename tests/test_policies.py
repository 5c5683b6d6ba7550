"""Tiers, routing, admission and rate limits: pure functions, no Ray, no torch."""

from __future__ import annotations

import pytest

from policies.admission import should_shed
from policies.rate_limit import RateLimiter
from policies.routing import PoolLoad, RequestFeatures, choose_pool
from policies.tiers import Tier, meets_slo, resolve_tier

INTERACTIVE = Tier(name="interactive", ttft_ms=400, tpot_ms=25, pool="fast")
STANDARD = Tier(
    name="standard", ttft_ms=2000, tpot_ms=60, pool="fast", overflow_pool="bulk",
    shed_at_queue_fraction=0.75,
)  # fmt: skip
BATCH = Tier(name="batch", ttft_ms=60000, tpot_ms=500, pool="bulk", shed_at_queue_fraction=0.5)
SMALL = RequestFeatures(num_prompt_tokens=100, max_tokens=50)


def _loads(fast_in_flight: int, max_request_tokens: int | None = None) -> dict[str, PoolLoad]:
    return {
        "fast": PoolLoad(
            fast_in_flight, capacity=4, max_queued=8, max_request_tokens=max_request_tokens
        ),
        "bulk": PoolLoad(0, capacity=64, max_queued=256),
    }


@pytest.mark.parametrize(
    ("header", "body", "key_default", "expected"),
    [
        ("interactive", "batch", "batch", "interactive"),
        (None, "batch", "interactive", "batch"),
        (None, None, "batch", "batch"),
        (None, None, None, "standard"),
    ],
)
def test_tier_comes_from_header_then_body_then_key(header, body, key_default, expected) -> None:
    known = ["interactive", "standard", "batch"]
    assert resolve_tier(header, body, key_default, "standard", known) == expected


def test_unknown_tier_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown SLA tier 'gold'"):
        resolve_tier("gold", None, None, "standard", ["standard"])


def test_slo_needs_both_ttft_and_tpot() -> None:
    assert meets_slo(INTERACTIVE, ttft_s=0.3, tpot_s=0.02)
    assert not meets_slo(INTERACTIVE, ttft_s=0.5, tpot_s=0.02)
    assert not meets_slo(INTERACTIVE, ttft_s=0.3, tpot_s=0.03)
    assert meets_slo(INTERACTIVE, ttft_s=0.3, tpot_s=None)


def test_interactive_and_batch_stay_on_their_pools() -> None:
    assert choose_pool(INTERACTIVE, SMALL, _loads(fast_in_flight=100)) == "fast"
    assert choose_pool(BATCH, SMALL, _loads(fast_in_flight=0)) == "bulk"


def test_standard_overflows_when_the_fast_pool_is_full_or_the_request_too_big() -> None:
    assert choose_pool(STANDARD, SMALL, _loads(fast_in_flight=3)) == "fast"
    assert choose_pool(STANDARD, SMALL, _loads(fast_in_flight=4)) == "bulk"
    assert choose_pool(STANDARD, SMALL, _loads(0, max_request_tokens=149)) == "bulk"
    assert choose_pool(STANDARD, SMALL, _loads(0, max_request_tokens=150)) == "fast"


def test_lowest_tier_is_shed_first() -> None:
    # capacity 4, queue limit 8: batch may queue 4, standard 6, interactive 8.
    def shed(tier: Tier, in_flight: int) -> bool:
        return should_shed(tier, PoolLoad(in_flight, capacity=4, max_queued=8))

    assert not shed(BATCH, 7) and shed(BATCH, 8)
    assert not shed(STANDARD, 9) and shed(STANDARD, 10)
    assert not shed(INTERACTIVE, 11) and shed(INTERACTIVE, 12)


def test_no_queue_sheds_as_soon_as_the_batch_is_full() -> None:
    assert not should_shed(INTERACTIVE, PoolLoad(3, capacity=4, max_queued=0))
    assert should_shed(INTERACTIVE, PoolLoad(4, capacity=4, max_queued=0))


def test_requests_per_minute_refill_over_time() -> None:
    limiter = RateLimiter()
    allow = [limiter.acquire("k", 1, 0.0, 2, None) for _ in range(3)]
    assert allow[:2] == [None, None]
    assert allow[2] == pytest.approx(30.0)  # one request refills every 30 s at 2/min
    assert limiter.acquire("k", 1, 30.0, 2, None) is None


def test_tokens_per_minute_and_refusals_cost_nothing() -> None:
    limiter = RateLimiter()
    assert limiter.acquire("k", 600, 0.0, None, 1000) is None
    assert limiter.acquire("k", 600, 0.0, None, 1000) == pytest.approx(12.0)
    assert limiter.acquire("k", 400, 0.0, None, 1000) is None


def test_keys_are_limited_separately_and_none_means_unlimited() -> None:
    limiter = RateLimiter()
    assert limiter.acquire("a", 1, 0.0, 1, None) is None
    assert limiter.acquire("b", 1, 0.0, 1, None) is None
    assert all(limiter.acquire("c", 10**6, 0.0, None, None) is None for _ in range(100))
