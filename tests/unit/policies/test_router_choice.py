"""The difficulty router follows the student: the ingress uses the router beside the student
its small pool serves, the configured one only for the student it was fitted to, and none
(saying why) for a student no router at hand was fitted to."""

from __future__ import annotations

from dataclasses import replace

from policies.difficulty import FEATURE_NAMES, DifficultyModel, StudentIdentity
from policies.router_choice import ServedStudent, choose_router

FRESH = StudentIdentity("student-v2", "f" * 64, "custom-t2")
DEFAULT = StudentIdentity("student-v1", "d" * 64, "default-t2")


def router(student: StudentIdentity | None, bias: float = 0.0) -> DifficultyModel:
    """A router fitted to `student` (its bias tells routers apart)."""
    n = len(FEATURE_NAMES)
    return DifficultyModel(
        FEATURE_NAMES, (0.0,) * n, bias, (0.0,) * n, (1.0,) * n, 0.5, 0.5, student
    )


COMMITTED = router(replace(DEFAULT, name="tierserve distill", weights_sha256=None), bias=1.0)
"""configs/router.json: fitted to the default recipe, not to one student's weights."""


def test_the_router_beside_the_served_student_is_used_before_the_fallback() -> None:
    own = router(FRESH)
    choice = choose_router([ServedStudent(FRESH, own)] * 2, COMMITTED)
    assert (choice.router, choice.state, choice.student) == (own, "student", FRESH)
    assert choice.warning is None


def test_the_fallback_routes_only_for_the_student_it_was_fitted_to() -> None:
    choice = choose_router([ServedStudent(DEFAULT)], COMMITTED)
    assert (choice.router, choice.state, choice.warning) == (COMMITTED, "fallback", None)

    refused = choose_router([ServedStudent(FRESH)], COMMITTED)
    assert (refused.router, refused.state, refused.student) == (None, "refused", FRESH)
    assert refused.warning is not None
    assert "tierserve distill" in refused.warning and "student-v2" in refused.warning


def test_a_router_beside_the_student_but_fitted_to_another_is_refused() -> None:
    """A router copied into another student's folder is not trusted for where it lies."""
    copied = router(DEFAULT)
    choice = choose_router([ServedStudent(FRESH, copied)], None)
    assert (choice.router, choice.state) == (None, "refused")
    assert choice.warning is not None
    assert "student-v1" in choice.warning and "student-v2" in choice.warning
    # ...while the fallback, fitted to the served student's recipe, still routes for it.
    beside_default = choose_router([ServedStudent(DEFAULT, router(FRESH))], COMMITTED)
    assert (beside_default.router, beside_default.state) == (COMMITTED, "fallback")


def test_a_router_that_records_no_student_is_refused_even_as_the_fallback() -> None:
    old = router(None)  # a version 1 file
    choice = choose_router([ServedStudent(DEFAULT, old)], old)
    assert (choice.router, choice.state) == (None, "refused")
    assert choice.warning is not None and "no recorded student" in choice.warning


def test_no_router_at_all_says_so() -> None:
    choice = choose_router([ServedStudent(FRESH)], None)
    assert (choice.router, choice.state) == (None, "missing")
    assert choice.warning is not None and "tierserve router train" in choice.warning


def test_replicas_serving_different_students_route_nothing_by_difficulty() -> None:
    served = [ServedStudent(DEFAULT), ServedStudent(FRESH, router(FRESH))]
    choice = choose_router(served, COMMITTED)
    assert (choice.router, choice.state, choice.student) == (None, "mixed", None)
    assert choice.warning is not None
    assert "student-v1" in choice.warning and "student-v2" in choice.warning


def test_a_pool_serving_no_student_or_not_heard_yet_has_no_router() -> None:
    not_a_student = choose_router([None], COMMITTED)
    assert (not_a_student.router, not_a_student.state) == (None, "not_a_student")
    assert not_a_student.warning is not None
    waiting = choose_router([], COMMITTED)
    assert (waiting.router, waiting.state, waiting.warning) == (None, "waiting", None)
