"""Where students live in the cache, which one `model: student` means, and what lies beside
each: its model card and the router fitted to it.

Pure paths, no torch: the loader, the pools and the CLI all ask here. A student
folder is `<cache>/students/student-v<N>`, written complete under a temporary
name and renamed (see engine.model.loader.partial_path); the newest version wins.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

STUDENT_MODEL = "student"
"""The model name that resolves to the newest distilled student."""
CARD_FILE = "model_card.json"
ROUTER_FILE = "router.json"
"""The difficulty router fitted to a student, in the student's folder (`tierserve router
train` writes it there, its report beside it): a router goes where its student goes."""
_VERSION = re.compile(r"^student-v(\d+)$")


class StudentMissing(ValueError):
    """No student has been distilled into this cache yet (`tierserve distill` makes one)."""


def students_dir(cache_dir: Path) -> Path:
    """The folder holding every student version and the distillation's work folder."""
    return Path(cache_dir) / "students"


def student_versions(cache_dir: Path) -> list[tuple[int, Path]]:
    """Every complete student, oldest first, as (version, folder)."""
    root = students_dir(cache_dir)
    if not root.is_dir():
        return []
    found = []
    for folder in root.iterdir():
        match = _VERSION.match(folder.name)
        if match and (folder / CARD_FILE).is_file():
            found.append((int(match.group(1)), folder))
    return sorted(found)


def latest_student(cache_dir: Path) -> Path:
    """The newest student's folder; StudentMissing when there is none."""
    versions = student_versions(cache_dir)
    if not versions:
        raise StudentMissing(
            f"no distilled student in {students_dir(cache_dir)}: run `tierserve distill` "
            "(or `make distill`) to make one"
        )
    return versions[-1][1]


def next_student_dir(cache_dir: Path) -> Path:
    """The folder the next student is published as (one version past the newest)."""
    versions = student_versions(cache_dir)
    number = versions[-1][0] + 1 if versions else 1
    return students_dir(cache_dir) / f"student-v{number}"


def student_folder(model: str, cache_dir: Path) -> Path | None:
    """The student folder an engine's `model` names: the newest for `student` (StudentMissing
    when there is none), a folder with a model card, else None (not a student)."""
    if model == STUDENT_MODEL:
        return latest_student(cache_dir)
    folder = Path(model).expanduser()
    return folder if (folder / CARD_FILE).is_file() else None


def read_card(folder: Path) -> dict[str, Any]:
    """A student's model card."""
    card: dict[str, Any] = json.loads((folder / CARD_FILE).read_text())
    return card
