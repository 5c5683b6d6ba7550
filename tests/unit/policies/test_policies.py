"""Tiers, routing, admission and rate limits: pure functions, no Ray, no torch."""

from __future__ import annotations

import pytest

from policies.rate_limit import RateLimiter, RequestTooLarge
from policies.tiers import TPOT_HEADROOM, Tier, meets_slo, resolve_tier

INTERACTIVE = Tier(name="interactive", ttft_ms=400, tpot_ms=25, pool="fast")
STANDARD = Tier(
    name="standard", ttft_ms=2000, tpot_ms=60, pool="fast", overflow_pool="bulk",
)  # fmt: skip
BATCH = Tier(name="batch", ttft_ms=60000, tpot_ms=500, pool="bulk")


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


def test_sequences_per_minute_refill_over_time() -> None:
    limiter = RateLimiter()
    allow = [limiter.acquire("k", 1, 1, 0.0, 2, None) for _ in range(3)]
    assert allow[:2] == [None, None]
    assert allow[2] == pytest.approx(30.0)  # one sequence refills every 30 s at 2/min
    assert limiter.acquire("k", 1, 1, 30.0, 2, None) is None


def test_a_request_counts_each_of_its_sequences() -> None:
    limiter = RateLimiter()
    assert limiter.acquire("k", 3, 3, 0.0, 4, None) is None
    assert limiter.acquire("k", 2, 2, 0.0, 4, None) == pytest.approx(15.0)
    assert limiter.acquire("k", 1, 1, 0.0, 4, None) is None


def test_tokens_per_minute_and_refusals_cost_nothing() -> None:
    limiter = RateLimiter()
    assert limiter.acquire("k", 1, 600, 0.0, None, 1000) is None
    assert limiter.acquire("k", 1, 600, 0.0, None, 1000) == pytest.approx(12.0)
    assert limiter.acquire("k", 1, 400, 0.0, None, 1000) is None


def test_a_request_larger_than_the_bucket_is_refused_not_let_through() -> None:
    limiter = RateLimiter()
    with pytest.raises(RequestTooLarge, match="needs 1500 tokens but the limit is 1000") as error:
        limiter.acquire("k", 1, 1500, 0.0, None, 1000)
    assert (error.value.unit, error.value.amount, error.value.capacity) == ("tokens", 1500, 1000)
    with pytest.raises(RequestTooLarge, match="sequences"):
        limiter.acquire("k", 5, 5, 0.0, 4, None)
    assert limiter.acquire("k", 1, 1000, 0.0, None, 1000) is None  # the refusal cost nothing


def test_keys_are_limited_separately_and_none_means_unlimited() -> None:
    limiter = RateLimiter()
    assert limiter.acquire("a", 1, 1, 0.0, 1, None) is None
    assert limiter.acquire("b", 1, 1, 0.0, 1, None) is None
    assert all(limiter.acquire("c", 16, 10**6, 0.0, None, None) is None for _ in range(100))


def test_the_engine_is_asked_for_the_tpot_with_headroom_and_batch_for_none():
    """A step kept within its target by prediction lands over it as often as under: the
    engine's target is TPOT_HEADROOM of the tier's, so what the client measures meets it."""
    interactive = Tier(name="interactive", ttft_ms=400, tpot_ms=25, pool="p", on_slo_miss="protect")
    batch = Tier(name="batch", ttft_ms=60_000, tpot_ms=500, pool="p", on_slo_miss="queue")
    assert interactive.tpot_target_s == pytest.approx(TPOT_HEADROOM * 0.025)
    assert 0.8 <= TPOT_HEADROOM < 1.0
    assert batch.tpot_target_s is None
