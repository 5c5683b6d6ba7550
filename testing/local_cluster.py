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
from collections.abc import Callable, Iterator
from contextlib import contextmanager

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


def _worker_env() -> dict[str, str]:
    """Workers import the repo's packages and use one torch thread."""
    return {"RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}


class SharedCluster:
    """One private Ray cluster with Serve started, kept across `serving` blocks.

    Starting and stopping a cluster costs tens of seconds on two cores; tests that
    deploy one app after another share one (the integration tests' conftest holds it),
    each block deploying its app and deleting it, or keeping it for the next (`deploy`).
    A module that starts a cluster of its own stops the shared one first (`stop`)."""

    port: int | None = None
    """Serve's HTTP port while the cluster runs."""
    kept: tuple[TierserveConfig, EngineFactory | None] | None = None
    """The config and engine class of the app a `keep` block left deployed."""

    @classmethod
    def start(cls) -> int:
        """The running cluster's port, starting it if needed."""
        if cls.port is None:
            _start_ray()
            cls.port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": cls.port})
        return cls.port

    @classmethod
    def stop(cls) -> None:
        if cls.port is not None:
            cls.port = None
            cls.kept = None
            serve.shutdown()
            ray.shutdown()

    @classmethod
    def deploy(cls, config: TierserveConfig, engine_cls: EngineFactory | None, keep: bool) -> None:
        """Run the app and wait until /health answers 200, unless a `keep` block left this
        very app deployed and this one keeps it too; an app kept for another is deleted."""
        app = (config, engine_cls)
        if keep and cls.kept == app:
            return
        if cls.kept is not None:
            cls.kept = None
            serve.delete("tierserve")
        serve.run(build_app(config, engine_cls), name="tierserve", route_prefix="/", blocking=False)
        _wait_healthy(f"http://127.0.0.1:{cls.port}")
        cls.kept = app if keep else None


def _start_ray() -> None:
    # Ray 2.60 local clusters turn on token auth, which breaks `serve.shutdown`.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _temp_dir=tempfile.mkdtemp(prefix="ts-ray-"),
        runtime_env={"env_vars": _worker_env()},
    )


@contextmanager
def serving(
    config: TierserveConfig,
    engine_cls: EngineFactory | None = None,
    shared: bool = False,
    keep: bool = False,
) -> Iterator[str]:
    """Run the app until the block ends; yields its base URL once /health answers 200.

    On a cluster of its own, started and stopped around the block, or with `shared` on
    the SharedCluster. With `keep` too the app outlives the block, and the next `keep`
    block of the same config and engine class serves from it: starting real engines costs
    25-45 s of both cores (SharedCluster.deploy). A private cluster tests or measures what
    is cached: a small pool without a student waits rather than distil in the background
    (minutes of both cores)."""
    pools = tuple(p.model_copy(update={"distill_if_missing": False}) for p in config.pools)
    config = config.model_copy(update={"pools": pools})
    own = not shared
    if own:
        SharedCluster.stop()
    port = SharedCluster.start()
    try:
        SharedCluster.deploy(config, engine_cls, keep)
        yield f"http://127.0.0.1:{port}"
    finally:
        if own:
            SharedCluster.stop()
        elif SharedCluster.kept is None:
            serve.delete("tierserve")


def _wait_healthy(base_url: str) -> None:
    if not wait_until_ok(f"{base_url}/health", READY_TIMEOUT_S):
        raise TimeoutError(f"tierserve at {base_url} not healthy after {READY_TIMEOUT_S}s")


def wait_until_ok(
    url: str, timeout_s: float, interval_s: float = 0.5, alive: Callable[[], bool] = lambda: True
) -> bool:
    """Poll `url` until it answers 200 (True), or until `timeout_s` passes or the server
    is no longer `alive()` (False)."""
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s and alive():
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(interval_s)
    return False


def kill_replica(deployment: str) -> str:
    """Kill (for good: Serve must start a new one) a replica actor of `deployment` in the
    cluster this process is connected to; its actor name."""
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].startswith("SERVE_REPLICA::") and f"#{deployment}#" in actor["name"]:
            ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
            return str(actor["name"])
    raise LookupError(f"no replica actor of {deployment!r}")
