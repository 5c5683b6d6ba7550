"""Model choice: a named model is pinned, `auto` consults the router only where the tier
allows it and the small model serves, and an easy request keeps its usual pool as overflow."""

from __future__ import annotations

import pytest

from policies.model_routing import AUTO_MODEL, ModelRoutes, choose_model
from policies.tiers import Tier

ROUTES = ModelRoutes("big", "small-model", "small")
STANDARD = Tier(
    name="standard", ttft_ms=2000, tpot_ms=60, pool="interactive",
    overflow_pool="offline", difficulty_routing=True,
)  # fmt: skip
INTERACTIVE = STANDARD.model_copy(update={"name": "interactive", "difficulty_routing": False})


def scorer(probability: float, easy: bool):
    """A router verdict, recording whether it was asked."""
    calls = []

    def score() -> tuple[float, bool]:
        calls.append(1)
        return probability, easy

    return score, calls


def test_auto_sends_an_easy_request_to_the_small_pool_with_its_pool_as_overflow():
    score, calls = scorer(0.8, True)
    choice = choose_model(AUTO_MODEL, STANDARD, ROUTES, True, score)
    assert (choice.model, choice.reason) == ("small-model", "easy")
    assert (choice.tier.pool, choice.tier.overflow_pool) == ("small", "interactive")
    assert choice.tier.keep_to_pool  # the small pool first, even when the overflow is cheaper
    assert choice.tier.name == "standard" and choice.tier.ttft_ms == STANDARD.ttft_ms
    assert choice.difficulty == pytest.approx(0.2) and calls == [1]


def test_auto_keeps_a_hard_request_on_the_default_model():
    score, _ = scorer(0.3, False)
    choice = choose_model(AUTO_MODEL, STANDARD, ROUTES, True, score)
    assert (choice.model, choice.reason, choice.tier) == ("big", "hard", STANDARD)
    assert choice.difficulty == pytest.approx(0.7)


@pytest.mark.parametrize(
    ("tier", "available", "reason"),
    [(INTERACTIVE, True, "not_routed"), (STANDARD, False, "small_unavailable")],
)
def test_the_router_is_not_asked_where_it_may_not_route(tier, available, reason):
    score, calls = scorer(1.0, True)
    choice = choose_model(AUTO_MODEL, tier, ROUTES, available, score)
    assert (choice.model, choice.reason, choice.tier) == ("big", reason, tier)
    assert calls == [] and choice.difficulty is None


def test_auto_stays_on_the_default_model_without_a_router_for_the_student():
    choice = choose_model(AUTO_MODEL, STANDARD, ROUTES, True, None)
    assert (choice.model, choice.reason, choice.tier) == ("big", "no_router", STANDARD)
    assert choice.difficulty is None
    pinned = choose_model("small-model", STANDARD, ROUTES, True, None)
    assert (pinned.model, pinned.reason) == ("small-model", "pinned")


def test_named_models_are_pinned_without_scoring():
    score, calls = scorer(1.0, True)
    small = choose_model("small-model", INTERACTIVE, ROUTES, False, score)
    assert (small.model, small.reason) == ("small-model", "pinned")
    assert (small.tier.pool, small.tier.overflow_pool) == ("small", None)
    big = choose_model("big", STANDARD, ROUTES, True, score)
    assert (big.model, big.reason, big.tier) == ("big", "pinned", STANDARD)
    assert calls == []


def test_without_a_small_model_auto_is_the_default():
    score, calls = scorer(1.0, True)
    routes = ModelRoutes("big")
    assert routes.names == (AUTO_MODEL, "big")
    choice = choose_model(AUTO_MODEL, STANDARD, routes, True, score)
    assert (choice.model, choice.reason) == ("big", "not_routed") and calls == []
