"""Which distilled student a pool replica serves, and the router fitted to it: read from the
cache when the replica loads its model, reported with its stats, so the ingress picks the
router that belongs to that student (policies/router_choice.py).

The replica reads the router, not the ingress: the student's folder is in the
replica's cache, which the ingress (perhaps on another node) may not see.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from engine.config import EngineConfig
from engine.model.students import ROUTER_FILE, read_card, student_folder
from policies.difficulty import DifficultyModel, StudentIdentity
from policies.router_choice import ServedStudent

log = logging.getLogger(__name__)


def pin_student(config: EngineConfig) -> tuple[EngineConfig, ServedStudent | None]:
    """`config` with `model: student` pinned to the newest student's folder, and what that
    folder holds (None for a model that is no student). Pinned before the engine loads,
    so the replica reports the very student it loaded even if a newer one is published
    meanwhile. StudentMissing while there is no student."""
    folder = student_folder(config.model, config.cache_dir)
    if folder is None:
        return config, None
    identity = StudentIdentity.from_card(folder.name, read_card(folder))
    return replace(config, model=str(folder)), ServedStudent(identity, _router_beside(folder))


def _router_beside(folder: Path) -> DifficultyModel | None:
    """The router in the student's folder; None when there is none or it cannot be read
    (logged: the ingress then falls back to the configured router, if that fits)."""
    path = folder / ROUTER_FILE
    if not path.is_file():
        return None
    try:
        return DifficultyModel.load(path)
    except ValueError as error:
        log.warning("ignoring the router beside the student, %s: %s", path, error)
        return None
