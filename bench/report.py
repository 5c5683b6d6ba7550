"""How every benchmark reports: one JSON object per metric on stdout, logs on stderr."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import cache
from typing import Any


@cache
def git_commit() -> str:
    """The short commit hash of the code being measured ("unknown" outside git)."""
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def emit(bench: str, metric: str, value: float, unit: str, **extra: Any) -> None:
    """Print one benchmark figure as a JSON line on stdout."""
    record = {"bench": bench, "metric": metric, "value": round(float(value), 4), "unit": unit}
    record.update(extra, commit=git_commit())
    print(json.dumps(record), flush=True)
    log(f"{metric:<40} {value:>12.3f} {unit}")


def log(message: str) -> None:
    """Print a human-readable line on stderr."""
    print(message, file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]; one value is its own every percentile."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
