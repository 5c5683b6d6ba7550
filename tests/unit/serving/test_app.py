"""The Serve graph build_app makes from configs/local.yaml, read as Serve will start it and as
Serve's `serve build` writes it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml
from ray.serve._private.build_app import build_app as serve_deployments
from ray.serve.schema import ServeDeploySchema

from bench.paths import REPO_ROOT
from serving.app import DRAIN_POLL_S, build_app
from serving.app_config import load_config
from serving.default_app import CONFIG_FILE


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


def test_serve_build_writes_a_config_of_the_default_app(tmp_path):
    """Ray Serve's own config generator on `serving.default_app:app` (configs/local.yaml's
    app): a config Serve's schema loads, naming every deployment with its pool's CPUs."""
    out = tmp_path / "serve_config.yaml"
    command = [str(Path(sys.executable).with_name("serve")), "build", "serving.default_app:app",
               "-o", str(out)]  # fmt: skip
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    built = ServeDeploySchema.model_validate(yaml.safe_load(out.read_text()))
    (app,) = built.applications
    assert app.import_path == "serving.default_app:app"
    config = load_config(CONFIG_FILE)
    deployments = {d.name: d for d in app.deployments}
    assert {"Ingress", "BatchRunner"} | {f"pool-{p.name}" for p in config.pools} == set(deployments)
    for pool in config.pools:
        assert deployments[f"pool-{pool.name}"].ray_actor_options.num_cpus == pool.num_cpus
