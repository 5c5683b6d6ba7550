"""The tierserve config file: the ingress's config plus app-level settings, read from YAML.

The same models validate `applications[].args` of a Serve config file
(configs/local.yaml, the KubeRay RayService, the Anyscale service).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, model_validator

from serving.config import IngressConfig
from serving.strict_model import require_at_least


class TierserveConfig(IngressConfig):
    """Everything the Serve app is built from."""

    ingress_num_cpus: float = Field(default=0.0, ge=0)
    ingress_num_replicas: int = Field(default=1, ge=1)
    """Ingress replicas behind Serve's proxy; more than one shares the semantic cache only
    with its Redis backend (each replica's memory store is its own)."""
    graceful_shutdown_timeout_s: float = Field(default=900.0, gt=0)
    """How long a replica being stopped or replaced drains its requests: at least
    request_timeout_s, so a downscale never cuts a request still in its time."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """The ingress's Serve log level; INFO writes one line per request."""

    @model_validator(mode="after")
    def _check_drain(self) -> TierserveConfig:
        require_at_least(self, "graceful_shutdown_timeout_s", "request_timeout_s")
        return self


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
