"""Ray Serve's own config generator, `serve build`, on configs/local.yaml's app
(`serving.default_app:app`), in a process of its own as a user would run it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml
from ray.serve.schema import ServeDeploySchema

from bench.paths import REPO_ROOT
from serving.app_config import load_config
from serving.default_app import CONFIG_FILE


def test_serve_build_writes_a_config_of_the_default_app(tmp_path: Path) -> None:
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
