"""Which difficulty router the ingress may use: the one fitted to the student its small pool
serves, or none.

A router learns where one student's answers keep the default model's quality;
another student fails on other requests, so its router would move the wrong
ones. Each small-pool replica reports the student it loaded and the router
written beside it (engine.model.students.ROUTER_FILE); the app's configured
router (`small_model.router_file`, configs/router.json) is the fallback, used
only where it fits the served student too (it records the default
distillation's recipe). Where no router fits, `model: auto` requests stay on
the default model (policies/model_routing.py's `no_router`) and the ingress
logs why, once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from policies.difficulty import DifficultyModel, StudentIdentity

RETRAIN = "train one for it with `tierserve router train`"


@dataclass(frozen=True)
class ServedStudent:
    """What a small-pool replica reports: the student it loaded and the router beside it."""

    identity: StudentIdentity
    router: DifficultyModel | None = None


@dataclass(frozen=True)
class RouterChoice:
    """The router to use (None: route nothing by difficulty), and why."""

    router: DifficultyModel | None
    state: str
    """`student` (the router beside the served student), `fallback` (the configured one
    fits it), `refused` (the routers at hand were fitted to other students), `missing`
    (no router at all), `mixed` (the live replicas serve different students),
    `not_a_student` (the pool serves no distilled student) or `waiting` (no replica has
    reported yet)."""
    student: StudentIdentity | None = None
    """The student the small pool serves, when its replicas agree on one."""
    warning: str | None = None
    """Why difficulty routing is off, for the log; None while it is on (or waiting)."""


def choose_router(
    served: Sequence[ServedStudent | None], fallback: DifficultyModel | None
) -> RouterChoice:
    """The router for the students `served` by the small pool's live replicas (None for a
    replica serving no distilled student), with `fallback` the configured router."""
    if not served:
        return RouterChoice(None, "waiting")
    first = served[0]
    if any(other != first for other in served[1:]):
        names = ", ".join(sorted({str(s.identity) if s else "no student" for s in served}))
        warning = f"the small pool's replicas serve different students ({names})"
        return RouterChoice(None, "mixed", warning=f"{warning}: no difficulty routing")
    if first is None:
        warning = "the small pool serves no distilled student: no router is known to fit it"
        return RouterChoice(None, "not_a_student", warning=f"{warning}, no difficulty routing")
    return _fitting(first, fallback)


def _fitting(served: ServedStudent, fallback: DifficultyModel | None) -> RouterChoice:
    """The router beside the student if it fits, else the fallback if that does."""
    student = served.identity
    candidates = {"student": served.router, "fallback": fallback}
    for state, router in candidates.items():
        if router is not None and router.fits(student):
            return RouterChoice(router, state, student)
    at_hand = [router for router in candidates.values() if router is not None]
    if not at_hand:
        warning = f"no difficulty router for {student}: no difficulty routing; {RETRAIN}"
        return RouterChoice(None, "missing", student, warning)
    fitted = " and ".join(str(r.student or "no recorded student") for r in at_hand)
    warning = (
        f"refusing the difficulty router fitted to {fitted}: the small pool serves "
        f"{student}; no difficulty routing until one fits it ({RETRAIN})"
    )
    return RouterChoice(None, "refused", student, warning)
