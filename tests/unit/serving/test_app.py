"""The Serve graph build_app makes from configs/local.yaml, read as Serve will start it."""

from __future__ import annotations

from ray.serve._private.build_app import build_app as serve_deployments

from serving.app import DRAIN_POLL_S, build_app
from serving.app_config import load_config


def test_every_deployment_drains_and_looks_for_running_requests_often():
    """Serve's own deployment configs (its private builder: the public API starts Ray)."""
    config = load_config("configs/local.yaml")
    built = serve_deployments(build_app(config), name="tierserve")
    names = {d.name for d in built.deployments}
    assert {"Ingress", "BatchRunner"} | {f"pool-{p.name}" for p in config.pools} <= names
    for deployment in built.deployments:
        options = deployment._deployment_config
        assert options.graceful_shutdown_timeout_s == config.graceful_shutdown_timeout_s
        assert options.graceful_shutdown_wait_loop_s == DRAIN_POLL_S
