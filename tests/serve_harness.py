"""Integration-test helpers: the app on a private Ray cluster (with the test fakes importable),
and /metrics read back by name and labels."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from load import local_cluster
from app.config import TierserveConfig
from deployments.pool import EngineFactory

TESTS_DIR = Path(__file__).resolve().parent


@contextmanager
def serving(config: TierserveConfig, engine_cls: EngineFactory | None = None) -> Iterator[str]:
    """local_cluster.serving, with tests/ on the workers' path so `fakes` imports there."""
    with local_cluster.serving(config, engine_cls, python_path=[TESTS_DIR]) as base_url:
        yield base_url


def metric(base_url: str, name: str, **labels: str) -> float:
    """The first sample of `name` on /metrics whose labels include `labels`."""
    text = httpx.get(f"{base_url}/metrics").text
    want = [f'{k}="{v}"' for k, v in labels.items()]
    for line in text.splitlines():
        if line.startswith(name + "{") and all(w in line for w in want):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{name} {labels} not in /metrics")


def wait_for_metric(
    base_url: str, name: str, value: float, timeout_s: float, **labels: str
) -> None:
    """Poll until the metric reads `value` (stats reach /metrics one poll period late)."""
    deadline = time.monotonic() + timeout_s
    while metric(base_url, name, **labels) != value and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(base_url, name, **labels) == value
