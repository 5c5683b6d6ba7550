"""The ingress's difficulty router follows what the small pool's replicas report serving:
the router beside a new student once it is rolled out, none (logged once, shown in /health)
for a student no router at hand was fitted to. A real pool monitor over a fake pool."""

from __future__ import annotations

import asyncio
import logging

import pytest

from engine.config import EngineConfig
from policies.difficulty import FEATURE_NAMES, DifficultyModel, StudentIdentity
from policies.router_choice import ServedStudent
from serving.config import PoolConfig
from serving.http.student_router import StudentRouter
from serving.pools.pool_monitor import PoolMonitor
from testing.fakes import FakeEngine, FakePoolHandle

OLD = StudentIdentity("student-v1", "1" * 64, "default-t2")
NEW = StudentIdentity("student-v2", "2" * 64, "custom-t2")


def router(student: StudentIdentity) -> DifficultyModel:
    n = len(FEATURE_NAMES)
    return DifficultyModel(
        FEATURE_NAMES, (0.0,) * n, 0.0, (0.0,) * n, (1.0,) * n, 0.5, 0.5, student
    )


FALLBACK = router(OLD)


def test_the_router_follows_the_student_the_pool_serves(caplog: pytest.LogCaptureFixture) -> None:
    handle = FakePoolHandle(FakeEngine(EngineConfig()), student=ServedStudent(OLD))
    monitor = PoolMonitor(
        {"small": PoolConfig(name="small", model_name="s")}, {"small": handle}, 1.0
    )
    routers = StudentRouter("small", FALLBACK, monitor)
    assert routers.choice().state == "waiting"  # nothing heard yet
    asyncio.run(monitor.poll_once())
    assert routers.choice().router is FALLBACK
    assert routers.health() == {"pool": "small", "router": "fallback", "student": str(OLD)}

    own = router(NEW)
    handle.student = ServedStudent(NEW, own)  # a new student, distilled with its router
    asyncio.run(monitor.poll_once())
    assert routers.choice().router == own

    handle.student = ServedStudent(NEW)  # ...and one without: the fallback is not its own
    asyncio.run(monitor.poll_once())
    with caplog.at_level(logging.WARNING, logger="serving.http.student_router"):
        assert routers.choice().router is None
        assert routers.choice().router is None
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1, "logged once, not per request"
    assert str(OLD) in warnings[0] and str(NEW) in warnings[0]
    health = routers.health()
    assert (health["router"], health["student"]) == ("refused", str(NEW))
    assert health["warning"] == warnings[0]
