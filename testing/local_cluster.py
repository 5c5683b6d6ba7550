"""Run a tierserve app on a private, local Ray cluster: for integration tests and benchmarks.

`serve run configs/local.yaml` is the way to serve; this is the way to drive
the same app from Python and be sure the cluster is gone afterwards. Each
run gets its own Ray temp dir and a free HTTP port, so it never attaches to
(or stops) another Ray instance on the machine.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx
import ray
from ray import serve

from bench.paths import REPO_ROOT
from serving.app import build_app
from serving.app_config import TierserveConfig
from serving.pools.pool import EngineFactory

READY_TIMEOUT_S = 300.0


def free_port() -> int:
    """A TCP port free on the loopback right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker_env(python_path: Sequence[Path]) -> dict[str, str]:
    """Workers import the repo's packages (plus `python_path`) and use one torch thread."""
    path = os.pathsep.join(str(p) for p in [REPO_ROOT, *python_path])
    return {"RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": path}


@contextmanager
def serving(
    config: TierserveConfig,
    engine_cls: EngineFactory | None = None,
    python_path: Sequence[Path] = (),
) -> Iterator[str]:
    """Run the app until the block ends; yields its base URL once /health answers 200.

    A private cluster tests or measures what is cached: a small pool without a student
    waits rather than distil in the background (minutes of both cores)."""
    pools = tuple(p.model_copy(update={"distill_if_missing": False}) for p in config.pools)
    config = config.model_copy(update={"pools": pools})
    port = free_port()
    # Ray 2.60 local clusters turn on token auth, which breaks `serve.shutdown`.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _temp_dir=tempfile.mkdtemp(prefix="ts-ray-"),
        runtime_env={"env_vars": _worker_env(python_path)},
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


def kill_replica(deployment: str) -> str:
    """Kill (for good: Serve must start a new one) a replica actor of `deployment` in the
    cluster this process is connected to; its actor name."""
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].startswith("SERVE_REPLICA::") and f"#{deployment}#" in actor["name"]:
            ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
            return str(actor["name"])
    raise LookupError(f"no replica actor of {deployment!r}")
