"""Integration modules that deploy through testing.serve_harness share one Ray cluster.

Modules that follow one another in the usual order (test_replica_failure to test_soak)
deploy and delete their apps on the cluster the first of them started; any other module
gets the machine without it, so a module that starts a cluster of its own, or measures
the CPU, is not disturbed. (Grouping every sharing module first changed the order the
in-process engine tests run in, and two of them depend on it: see the stop's note.)
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from testing import serve_harness
from testing.local_cluster import SharedCluster


def _shares_cluster(module: object) -> bool:
    return getattr(module, "serving", None) is serve_harness.serving


@pytest.fixture(autouse=True, scope="module")
def cluster_for_module(request: pytest.FixtureRequest) -> None:
    if not _shares_cluster(request.module):
        SharedCluster.stop()


@pytest.fixture(autouse=True, scope="session")
def shared_cluster_stopped_at_end() -> Iterator[None]:
    yield
    SharedCluster.stop()
