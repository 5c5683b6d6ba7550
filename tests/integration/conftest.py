"""Integration modules that deploy through testing.serve_harness share one Ray cluster.

Modules that follow one another in the usual order (test_replica_failure to test_soak)
deploy and delete their apps on the cluster the first of them started; any other module
gets the machine without it, so a module that starts a cluster of its own, or measures
the CPU, is not disturbed. (Grouping every sharing module first changed the order the
in-process engine tests run in, and two of them depend on it: see the stop's note.)
The modules that ask for `real_app_url` run in a row, where the first of them stands,
and share one deployment of the real-engine app.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from testing import serve_harness
from testing.local_cluster import SharedCluster


def _real_app_modules(items: list[pytest.Item]) -> set[object]:
    """The modules with a test asking for `real_app_url`."""
    return {
        getattr(item, "module", None)
        for item in items
        if "real_app_url" in getattr(item, "fixturenames", ())
    }


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the modules that ask for `real_app_url` one after another, where the first of
    them stands: one deployment of the real-engine app then serves them all (each start
    took 25-45 s of both cores; four modules' 200 s went to 98 s)."""
    modules = _real_app_modules(items)
    real = [item for item in items if getattr(item, "module", None) in modules]
    if real:
        first = items.index(real[0])
        others = [item for item in items if getattr(item, "module", None) not in modules]
        items[:] = others[:first] + real + others[first:]


def _shares_cluster(request: pytest.FixtureRequest) -> bool:
    """The module deploys through serve_harness: itself, or by asking for `real_app_url`."""
    module = request.module
    if getattr(module, "serving", None) is serve_harness.serving:
        return True
    return module in _real_app_modules(request.session.items)


@pytest.fixture(autouse=True, scope="module")
def cluster_for_module(request: pytest.FixtureRequest) -> None:
    if not _shares_cluster(request):
        SharedCluster.stop()


@pytest.fixture(scope="session")
def real_app_batch_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real-engine app's batch jobs folder: one for the session, so that every module
    asks for the same app."""
    return tmp_path_factory.mktemp("batches")


@pytest.fixture(scope="module")
def real_app_url(real_app_batch_dir: Path) -> Iterator[str]:
    """The app with real engines on the default model (serve_harness.real_engine_config):
    its base URL. Kept deployed after the module, for the next module that asks (they run
    in a row); deleted when another app is deployed or the cluster stops."""
    config = serve_harness.real_engine_config(real_app_batch_dir)
    with serve_harness.serving(config, keep=True) as url:
        yield url


@pytest.fixture
def real_client(real_app_url: str) -> openai.OpenAI:
    """The `openai` client of `real_app_url`'s app, without retries."""
    return openai.OpenAI(base_url=f"{real_app_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(autouse=True, scope="session")
def shared_cluster_stopped_at_end() -> Iterator[None]:
    yield
    SharedCluster.stop()
