"""Integration modules that deploy through testing.serve_harness share one Ray cluster.

Modules that follow one another in the usual order (test_replica_failure to test_soak)
deploy and delete their apps on the cluster the first of them started; any other module
gets the machine without it, so a module that starts a cluster of its own, or measures
the CPU, is not disturbed. (Grouping every sharing module first changed the order the
in-process engine tests run in, and two of them depend on it: see the stop's note.)
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from testing import serve_harness
from testing.local_cluster import SharedCluster


def _shares_cluster(request: pytest.FixtureRequest) -> bool:
    """The module deploys through serve_harness: itself, or by asking for `real_app_url`."""
    module = request.module
    if getattr(module, "serving", None) is serve_harness.serving:
        return True
    items = (item for item in request.session.items if getattr(item, "module", None) is module)
    return any("real_app_url" in getattr(item, "fixturenames", ()) for item in items)


@pytest.fixture(autouse=True, scope="module")
def cluster_for_module(request: pytest.FixtureRequest) -> None:
    if not _shares_cluster(request):
        SharedCluster.stop()


@pytest.fixture(scope="module")
def real_app_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The app with real engines on the default model (serve_harness.real_engine_config),
    one per module that asks: its base URL."""
    batch_dir = tmp_path_factory.mktemp("batches")
    with serve_harness.serving(serve_harness.real_engine_config(batch_dir)) as url:
        yield url


@pytest.fixture
def real_client(real_app_url: str) -> openai.OpenAI:
    """The `openai` client of `real_app_url`'s app, without retries."""
    return openai.OpenAI(base_url=f"{real_app_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(autouse=True, scope="session")
def shared_cluster_stopped_at_end() -> Iterator[None]:
    yield
    SharedCluster.stop()
