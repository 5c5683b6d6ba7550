"""Which model a request runs on: the one it names, or for `model: auto`, the small model
when the request is easy and its tier allows it.

The choice is expressed as the tier to place (policies/placement.py): an easy
request's tier runs on the small pool first, with its usual pool as overflow,
so placement still keeps it within its SLO when the small pool is busy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from policies.tiers import Tier

AUTO_MODEL = "auto"
"""The model name that lets the router choose."""


@dataclass(frozen=True)
class ModelRoutes:
    """The models a deployment serves: the default one and, optionally, a small one."""

    default_model: str
    small_model: str | None = None
    small_pool: str | None = None

    @property
    def names(self) -> tuple[str, ...]:
        """Every model name a request may give."""
        small = (self.small_model,) if self.small_model else ()
        return (AUTO_MODEL, self.default_model, *small)


@dataclass(frozen=True)
class ModelChoice:
    """Where a request goes, and why."""

    tier: Tier
    """The request's tier with the pools this choice allows."""
    model: str
    """The model chosen (never `auto`); overflow may still run it on the default model."""
    reason: str
    """`pinned` (named a model), `not_routed` (its tier does not route by difficulty),
    `small_unavailable`, `no_router` (none fits the student it serves:
    policies/router_choice.py), `easy` or `hard` (the router's verdict)."""
    difficulty: float | None = None
    """1 - P(the small model answers as well), when the router scored the request."""


def choose_model(
    requested: str,
    tier: Tier,
    routes: ModelRoutes,
    small_available: bool,
    p_small_suffices: Callable[[], tuple[float, bool]] | None,
) -> ModelChoice:
    """The model for a request naming `requested` (a served name or `auto`).

    `p_small_suffices()` scores the request only when the router is consulted: it
    returns the probability and whether that clears the router's threshold. None:
    no router fits the small model, so `auto` stays on the default one.
    """
    if requested == routes.small_model:
        return ModelChoice(_on_small(tier, routes, overflow=False), requested, "pinned")
    if requested != AUTO_MODEL:
        return ModelChoice(tier, requested, "pinned")
    if routes.small_model is None or not tier.difficulty_routing:
        return ModelChoice(tier, routes.default_model, "not_routed")
    if not small_available:
        return ModelChoice(tier, routes.default_model, "small_unavailable")
    if p_small_suffices is None:
        return ModelChoice(tier, routes.default_model, "no_router")
    probability, easy = p_small_suffices()
    if not easy:
        return ModelChoice(tier, routes.default_model, "hard", 1 - probability)
    on_small = _on_small(tier, routes, overflow=True)
    return ModelChoice(on_small, routes.small_model, "easy", 1 - probability)


def _on_small(tier: Tier, routes: ModelRoutes, overflow: bool) -> Tier:
    """The tier run on the small pool; with `overflow`, its own pool takes what the small
    pool cannot serve within the SLO."""
    overflow_pool = tier.pool if overflow else None
    return tier.model_copy(
        update={"pool": routes.small_pool, "overflow_pool": overflow_pool, "keep_to_pool": True}
    )
