"""Integration modules that deploy through testing.serve_harness share one Ray cluster.

They run one after another (collection groups them), each deploying and deleting
its app on the cluster the first one started; any other module gets the machine without
it, so a module that starts a cluster of its own, or measures the CPU, is not disturbed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from testing import serve_harness
from testing.local_cluster import SharedCluster

INTEGRATION_DIR = Path(__file__).resolve().parent


def _shares_cluster(module: object) -> bool:
    return getattr(module, "serving", None) is serve_harness.serving


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Unit tests first, then the sharing modules, then the other integration modules,
    each group in its usual order."""

    def group(item: pytest.Item) -> int:
        if not item.path.is_relative_to(INTEGRATION_DIR):
            return 0
        return 1 if _shares_cluster(getattr(item, "module", None)) else 2

    items.sort(key=group)


@pytest.fixture(autouse=True, scope="module")
def cluster_for_module(request: pytest.FixtureRequest) -> None:
    if not _shares_cluster(request.module):
        SharedCluster.stop()


@pytest.fixture(autouse=True, scope="session")
def shared_cluster_stopped_at_end() -> Iterator[None]:
    yield
    SharedCluster.stop()
