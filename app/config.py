"""The tierserve config file: the ingress's config plus app-level settings, read from YAML.

The same models validate `applications[].args` of a Serve config file
(configs/local.yaml, the KubeRay RayService, the Anyscale service).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import Field

from deployments.config import IngressConfig


class TierserveConfig(IngressConfig):
    """Everything the Serve app is built from."""

    ingress_num_cpus: float = Field(default=0.0, ge=0)


def load_serve_config(path: str | Path) -> dict[str, Any]:
    """Read a Serve config file (the YAML `serve run` takes)."""
    return yaml.safe_load(Path(path).read_text())


def load_config(path: str | Path, app_name: str = "tierserve") -> TierserveConfig:
    """The tierserve config held in `applications[name=app_name].args` of a Serve config file."""
    apps = load_serve_config(path)["applications"]
    app = next((a for a in apps if a["name"] == app_name), None)
    if app is None:
        raise ValueError(f"{path} has no application named {app_name!r}")
    return TierserveConfig.model_validate(app["args"])
