"""The three deployment targets' configs validate: Serve's schema for the Serve part,
tierserve's models for the app args, and the RayService's required structure."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from ray.serve import Application
from ray.serve.schema import ServeDeploySchema

from app.builder import app_builder
from app.config import TierserveConfig, load_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def _serve_configs() -> dict[str, dict]:
    rayservice = yaml.safe_load((CONFIGS / "kuberay" / "rayservice.yaml").read_text())
    anyscale = yaml.safe_load((CONFIGS / "anyscale" / "service.yaml").read_text())
    return {
        "local": yaml.safe_load((CONFIGS / "local.yaml").read_text()),
        "kuberay": yaml.safe_load(rayservice["spec"]["serveConfigV2"]),
        "anyscale": {"applications": anyscale["applications"]},
    }


@pytest.mark.parametrize("target", ["local", "kuberay", "anyscale"])
def test_serve_config_and_app_args_validate(target: str) -> None:
    serve_config = _serve_configs()[target]
    ServeDeploySchema.model_validate(serve_config)
    (app,) = serve_config["applications"]
    assert app["import_path"] == "app.builder:app_builder"
    config = TierserveConfig.model_validate(app["args"])
    assert {p.name for p in config.pools} == {"interactive", "offline"}
    assert {t.name for t in config.tiers} == {"interactive", "standard", "batch"}


def test_rayservice_has_the_structure_kuberay_requires() -> None:
    rayservice = yaml.safe_load((CONFIGS / "kuberay" / "rayservice.yaml").read_text())
    assert rayservice["apiVersion"] == "ray.io/v1" and rayservice["kind"] == "RayService"
    cluster = rayservice["spec"]["rayClusterConfig"]
    assert cluster["headGroupSpec"]["template"]["spec"]["containers"]
    (workers,) = cluster["workerGroupSpecs"]
    assert workers["groupName"] and workers["template"]["spec"]["containers"]
    gpu_limit = workers["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert gpu_limit["nvidia.com/gpu"] == "1"


def test_local_pools_fit_two_cpus() -> None:
    config = load_config(CONFIGS / "local.yaml")
    assert sum(p.num_cpus * p.max_replicas for p in config.pools) + config.ingress_num_cpus <= 2
    assert (
        config.pool("interactive").engine.max_num_seqs < config.pool("offline").engine.max_num_seqs
    )


def _args(**changes: object) -> dict:
    args = yaml.safe_load((CONFIGS / "local.yaml").read_text())["applications"][0]["args"]
    return {**args, **changes}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"default_tier": "gold"}, "default tier 'gold' is not a tier"),
        (
            {"tiers": [{"name": "x", "ttft_ms": 1, "tpot_ms": 1, "pool": "nope"}]},
            "names pool 'nope'",
        ),
        ({"typo_field": 1}, "Extra inputs are not permitted"),
    ],
)
def test_bad_config_fails_with_a_useful_message(changes: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        TierserveConfig.model_validate(_args(**changes))


def test_engine_settings_use_the_engines_own_validation() -> None:
    args = _args()
    args["pools"][0]["engine"]["dtype"] = "int3"
    with pytest.raises(ValidationError, match="dtype must be one of"):
        TierserveConfig.model_validate(args)


def test_app_builder_takes_the_raw_args_of_a_serve_config() -> None:
    """`serve run` hands the builder a plain dict, not the annotated model."""
    application = app_builder(_args())
    assert isinstance(application, Application)
