"""A pool of the distilled student, before any student exists: wait, optionally distilling.

`make serve` on a fresh machine must come up as fast as without a small model,
so a small-pool replica does not fail when the student is missing: it reports
itself unavailable (the ingress then routes nothing to it and says why in
/health), starts `tierserve distill` in the background when its pool asks for
that, and loads the student once it is published.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from engine.model.students import student_versions, students_dir

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 2.0
"""How often the cache is checked for a published student (a directory listing)."""


PROGRESS_PREFIX = "distill: step "
"""How the distillation's progress lines start (small_model.distill.trainer)."""


def waiting_reason(cache_dir: Path, distilling: bool) -> str:
    """What the pool reports while it waits (read again at each report: a background
    distillation's latest progress line says how far along it is)."""
    if not distilling:
        return "no distilled student yet: run `make distill` (or `tierserve distill`)"
    log_file = _log_path(cache_dir)
    reason = f"no distilled student yet: distilling in the background (log: {log_file})"
    progress = latest_progress(log_file)
    return f"{reason}; {progress}" if progress else reason


def latest_progress(log_file: Path) -> str | None:
    """The last progress line of a distillation's log (its tail only: the log grows)."""
    try:
        with open(log_file, "rb") as log_stream:
            log_stream.seek(max(0, log_stream.seek(0, os.SEEK_END) - 4096))
            tail = log_stream.read().decode(errors="replace").splitlines()
    except FileNotFoundError:
        return None
    lines = [line.strip() for line in tail if line.strip().startswith(PROGRESS_PREFIX)]
    return lines[-1].removeprefix("distill: ") if lines else None


def wait_for_student(cache_dir: Path, distill: bool) -> None:
    """Return once a student is published in `cache_dir` (blocking: run it in a thread);
    with `distill`, first start a background distillation at the lowest CPU priority, so
    serving keeps its cores. If that fails, the wait goes on: a manual
    `tierserve distill` still brings the pool up."""
    process = _start_distillation(cache_dir) if distill else None
    while not student_versions(cache_dir):
        if process is not None and process.poll() is not None:
            log.error(
                "background distillation exited with %s (see %s); waiting for a manual "
                "`tierserve distill`", process.returncode, _log_path(cache_dir),
            )  # fmt: skip
            process = None
        time.sleep(POLL_INTERVAL_S)
    if process is not None:
        process.wait()


def _start_distillation(cache_dir: Path) -> subprocess.Popen[bytes]:
    """`tierserve distill` in a child process at nice 19, logging to the cache."""
    path = _log_path(cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    distill = [sys.executable, "-m", "cli.main", "distill", "--quiet"]
    command = [*distill, "--cache-dir", str(cache_dir)]
    log.warning("no distilled student in %s: distilling in the background, log %s", cache_dir, path)
    with open(path, "ab") as output:
        return subprocess.Popen(
            command, stdout=output, stderr=output, preexec_fn=lambda: os.nice(19)
        )


def _log_path(cache_dir: Path) -> Path:
    return students_dir(cache_dir) / "distill.log"
