"""The difficulty router the ingress routes `model: auto` by: the one fitted to the student its
small pool serves now, as the pool's replicas last reported it (policies/router_choice.py).

Which student that is is only known once a replica has loaded one (the pool may
still be waiting for its distillation), and it changes when a newer student is
rolled out, so the choice is made again from each poll's reports, not once when
the app is built; the configured router is only the fallback.
"""

from __future__ import annotations

import logging
from typing import Any

from policies.difficulty import DifficultyModel
from policies.router_choice import RouterChoice, choose_router
from serving.pools.pool_monitor import PoolMonitor

log = logging.getLogger(__name__)


class StudentRouter:
    """The router for the small pool's current student; why none is used is logged once."""

    def __init__(self, pool: str, fallback: DifficultyModel | None, monitor: PoolMonitor) -> None:
        self._pool = pool
        self._fallback = fallback
        self._monitor = monitor
        self._warned: set[str] = set()

    def choice(self) -> RouterChoice:
        """The router to use now (its `router` None: route nothing by difficulty)."""
        choice = choose_router(self._monitor.served_students(self._pool), self._fallback)
        if choice.warning is not None and choice.warning not in self._warned:
            self._warned.add(choice.warning)
            log.warning(choice.warning)
        return choice

    def health(self) -> dict[str, Any]:
        """For /health: the small pool, the student it serves, which router routes for it
        (policies/router_choice.py's states) and, when none does, why."""
        choice = self.choice()
        details: dict[str, Any] = {"pool": self._pool, "router": choice.state}
        if choice.student is not None:
            details["student"] = str(choice.student)
        if choice.warning is not None:
            details["warning"] = choice.warning
        return details
