"""Start a tierserve app on a private Ray cluster and HTTP port, for integration tests."""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

# Ray 2.60 local clusters turn on token auth, which breaks serve shutdown in tests.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402
from ray import serve  # noqa: E402

from app.builder import build_app  # noqa: E402
from app.config import TierserveConfig  # noqa: E402
from deployments.pool import Engine  # noqa: E402

READY_TIMEOUT_S = 300.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker_env() -> dict[str, str]:
    """Workers import the repo's packages and the test fakes, and use one torch thread."""
    tests_dir = Path(__file__).resolve().parent
    python_path = os.pathsep.join([str(tests_dir.parent), str(tests_dir)])
    return {"RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path}


@contextmanager
def serving(config: TierserveConfig, engine_cls: type[Engine] | None = None) -> Iterator[str]:
    """Run the app until the block ends; yields its base URL once /health answers 200."""
    port = _free_port()
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _temp_dir=tempfile.mkdtemp(prefix="ts-ray-"),
        runtime_env={"env_vars": _worker_env()},
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(config, engine_cls), name="tierserve", route_prefix="/", blocking=False)
        base_url = f"http://127.0.0.1:{port}"
        _wait_healthy(base_url)
        yield base_url
    finally:
        serve.shutdown()
        ray.shutdown()


def _wait_healthy(base_url: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base_url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"tierserve at {base_url} not healthy after {READY_TIMEOUT_S}s")
