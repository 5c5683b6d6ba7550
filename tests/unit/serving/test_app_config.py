"""The three deployment targets' configs validate: Serve's schema for the Serve part,
tierserve's models for the app args, and the RayService's required structure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from ray.serve import Application
from ray.serve.schema import ServeDeploySchema

from bench.paths import CONFIGS_DIR
from serving.app import app_builder
from serving.app_config import TierserveConfig, load_config

CONFIGS = CONFIGS_DIR


def _serve_configs() -> dict[str, dict]:
    rayservice = yaml.safe_load((CONFIGS / "kuberay" / "rayservice.yaml").read_text())
    anyscale = yaml.safe_load((CONFIGS / "anyscale" / "service.yaml").read_text())
    return {
        "local": yaml.safe_load((CONFIGS / "local.yaml").read_text()),
        "kuberay": yaml.safe_load(rayservice["spec"]["serveConfigV2"]),
        "anyscale": {
            "http_options": anyscale["http_options"],
            "applications": anyscale["applications"],
        },
    }


@pytest.mark.parametrize("target", ["local", "kuberay", "anyscale"])
def test_serve_config_and_app_args_validate(target: str) -> None:
    serve_config = _serve_configs()[target]
    ServeDeploySchema.model_validate(serve_config)
    (app,) = serve_config["applications"]
    assert app["import_path"] == "serving.app:app_builder"
    config = TierserveConfig.model_validate(app["args"])
    assert {p.name for p in config.pools} == {"interactive", "offline", "small"}
    assert {t.name for t in config.tiers} == {"interactive", "standard", "batch"}
    assert config.small_model is not None and config.small_model.pool == "small"
    routed = {t.name for t in config.tiers if t.difficulty_routing}
    assert routed == {"standard", "batch"}  # easy requests of these may go to the student


def test_rayservice_has_the_structure_kuberay_requires() -> None:
    rayservice = yaml.safe_load((CONFIGS / "kuberay" / "rayservice.yaml").read_text())
    assert rayservice["apiVersion"] == "ray.io/v1" and rayservice["kind"] == "RayService"
    cluster = rayservice["spec"]["rayClusterConfig"]
    assert cluster["headGroupSpec"]["template"]["spec"]["containers"]
    for workers in cluster["workerGroupSpecs"]:
        assert workers["groupName"] and workers["template"]["spec"]["containers"]


def test_rayservice_worker_groups_autoscale_within_their_pools_replica_limits() -> None:
    rayservice = yaml.safe_load((CONFIGS / "kuberay" / "rayservice.yaml").read_text())
    cluster = rayservice["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    groups = {
        resource: group
        for group in cluster["workerGroupSpecs"]
        for resource in json.loads(json.loads(group["rayStartParams"]["resources"]))
    }
    _, args = _http_timeout_and_args("kuberay")
    for pool in TierserveConfig.model_validate(args).pools:
        (resource,) = pool.resources  # each replica needs its group's resource...
        group = groups[resource]
        assert pool.autoscaling is not None
        assert group["minReplicas"] == pool.autoscaling.min_replicas  # ...one pod per replica
        assert group["maxReplicas"] == pool.autoscaling.max_replicas
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert int(limits.get("nvidia.com/gpu", 0)) >= pool.num_gpus
        assert float(limits["cpu"]) >= pool.num_cpus


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
        ({"default_tier": "gold"}, "default_tier 'gold' is not a tier; tiers: \\['batch', "),
        ({"batch_jobs": {"tier": "bulk"}}, "batch_jobs.tier 'bulk' is not a tier"),
        ({"typo_field": 1}, "Extra inputs are not permitted"),
    ],
)
def test_bad_config_fails_with_a_useful_message(changes: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        TierserveConfig.model_validate(_args(**changes))


@pytest.mark.parametrize(
    ("pool", "message"),
    [
        ("nope", "small_model.pool 'nope' is not a pool; pools: \\['interactive', 'offline', "),
        ("interactive", "must not be a tier's pool"),
    ],
)
def test_the_small_model_must_be_a_pool_of_its_own(pool: str, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        TierserveConfig.model_validate(_args(small_model={"pool": pool}))


@pytest.mark.parametrize("field", ["pool", "overflow_pool"])
def test_a_tier_naming_a_missing_pool_is_refused_naming_the_field_and_pools(field: str) -> None:
    args = _args()
    args["tiers"][0][field] = "gpu"
    message = rf"tiers\[interactive\].{field} 'gpu' is not a pool; pools: \['interactive', "
    with pytest.raises(ValidationError, match=message):
        TierserveConfig.model_validate(args)


@pytest.mark.parametrize("draft", ["small", "SmolLM2-student"])
def test_a_draft_model_named_like_a_pool_is_refused_naming_its_engine_model(draft: str) -> None:
    args = _args()
    args["pools"][0]["engine"]["spec_decode"] = {"method": "draft", "draft_model": draft}
    message = rf"pools\[interactive\].engine.spec_decode.draft_model '{draft}' names pool 'small'"
    with pytest.raises(ValidationError, match=message + ".*use its engine model 'student'"):
        TierserveConfig.model_validate(args)


def test_a_draft_model_naming_an_engine_model_is_accepted() -> None:
    args = _args()
    args["pools"][0]["engine"]["spec_decode"] = {"method": "draft", "draft_model": "student"}
    TierserveConfig.model_validate(args)


def test_a_changed_copy_is_validated_again() -> None:
    """`model_copy(update=...)` skips validation; `with_changes` is how configs are derived."""
    config = TierserveConfig.model_validate(_args())
    with pytest.raises(ValidationError, match="small_model.pool 'small' is not a pool"):
        config.with_changes(pools=(config.pool("interactive"), config.pool("offline")))
    assert config.with_changes(log_level="DEBUG").log_level == "DEBUG"


def test_looking_up_a_missing_pool_names_the_pools() -> None:
    config = TierserveConfig.model_validate(_args())
    with pytest.raises(KeyError, match=r"no pool 'gpu'; pools: \['interactive', 'offline'"):
        config.pool("gpu")


def test_the_small_pool_must_serve_another_model() -> None:
    args = _args()
    small = next(p for p in args["pools"] if p["name"] == "small")
    small["model_name"] = args["model_name"]
    with pytest.raises(ValidationError, match="a model other than the default"):
        TierserveConfig.model_validate(args)


def test_engine_settings_use_the_engines_own_validation() -> None:
    args = _args()
    args["pools"][0]["engine"]["dtype"] = "int3"
    with pytest.raises(ValidationError, match="dtype must be one of"):
        TierserveConfig.model_validate(args)


def test_app_builder_takes_the_raw_args_of_a_serve_config() -> None:
    """`serve run` hands the builder a plain dict, not the annotated model."""
    application = app_builder(_args())
    assert isinstance(application, Application)


def _http_timeout_and_args(target: str) -> tuple[float, dict]:
    serve_config = _serve_configs()[target]
    return serve_config["http_options"]["request_timeout_s"], serve_config["applications"][0][
        "args"
    ]


@pytest.mark.parametrize("target", ["local", "kuberay", "anyscale"])
def test_proxy_timeout_is_a_backstop_above_every_deadline(target: str) -> None:
    """Serve's proxy must not cut a request the ingress would still answer with its own 408."""
    proxy_timeout_s, args = _http_timeout_and_args(target)
    config = TierserveConfig.model_validate(args)
    assert proxy_timeout_s > config.request_timeout_s
    assert config.graceful_shutdown_timeout_s >= config.request_timeout_s
    assert config.tier("batch").deadline_s == config.request_timeout_s


def test_rayservice_reads_keys_from_a_secret() -> None:
    rayservice = yaml.safe_load((CONFIGS / "kuberay" / "rayservice.yaml").read_text())
    _, args = _http_timeout_and_args("kuberay")
    (key,) = TierserveConfig.model_validate(args).gateway.api_keys
    assert key.key is None and key.key_env is not None
    cluster = rayservice["spec"]["rayClusterConfig"]
    containers = [cluster["headGroupSpec"]["template"]["spec"]["containers"][0]]
    containers += [g["template"]["spec"]["containers"][0] for g in cluster["workerGroupSpecs"]]
    for container in containers:  # the ingress may land on any node
        (env,) = [e for e in container["env"] if e["name"] == key.key_env]
        assert env["valueFrom"]["secretKeyRef"]["name"] == "tierserve-api-keys"


def _gateway(*keys: dict) -> dict:
    return {"require_api_key": True, "api_keys": list(keys)}


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ({"name": "a", "key": ""}, "API key 'a' is empty"),
        ({"name": "a", "key": "  "}, "API key 'a' is empty"),
        ({"name": "a"}, "exactly one of key, key_env, key_file"),
        ({"name": "a", "key": "x", "key_env": "X"}, "exactly one of key, key_env, key_file"),
        ({"name": "a", "key": "x", "allowed_tiers": ["gold"]}, "allows unknown tiers"),
        (
            {"name": "a", "key": "x", "default_tier": "batch", "allowed_tiers": ["interactive"]},
            "default_tier 'batch' is not in allowed_tiers",
        ),
    ],
)
def test_bad_api_keys_are_refused_at_config_load(key: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        TierserveConfig.model_validate(_args(gateway=_gateway(key)))


def test_keys_are_read_from_env_or_file_and_refused_when_empty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TS_TEST_KEY", "from-env")
    monkeypatch.setenv("TS_TEST_EMPTY", "")
    (tmp_path / "key").write_text("from-file\n")  # Secret files end with a newline
    (tmp_path / "empty").write_text("\n")
    config = TierserveConfig.model_validate(
        _args(
            gateway=_gateway(
                {"name": "env", "key_env": "TS_TEST_KEY"},
                {"name": "file", "key_file": str(tmp_path / "key")},
                {"name": "empty-env", "key_env": "TS_TEST_EMPTY"},
                {"name": "empty-file", "key_file": str(tmp_path / "empty")},
                {"name": "no-file", "key_file": str(tmp_path / "missing")},
            )
        )
    )
    env, file, empty_env, empty_file, no_file = config.gateway.api_keys
    assert env.read_key() == "from-env" and file.read_key() == "from-file"
    with pytest.raises(ValueError, match="'empty-env' is empty"):
        empty_env.read_key()
    with pytest.raises(ValueError, match="'empty-file' is empty"):
        empty_file.read_key()
    with pytest.raises(ValueError, match="does not exist"):
        no_file.read_key()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"request_timeout_s": 100}, "deadline_s 300.0 exceeds request_timeout_s 100"),
        ({"graceful_shutdown_timeout_s": 20}, "must be at least request_timeout_s"),
        ({"limits": {"max_body_bytes": 10}}, "max_body_bytes"),
    ],
)
def test_timeouts_and_limits_are_checked(changes: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        TierserveConfig.model_validate(_args(**changes))


def test_the_two_gpu_configs_serve_the_same_app() -> None:
    """Anyscale's args are KubeRay's but for where batch state lives and the custom resources
    that tie KubeRay's replicas to their pod groups (Anyscale places them by CPUs and GPUs)."""
    _, kuberay = _http_timeout_and_args("kuberay")
    _, anyscale = _http_timeout_and_args("anyscale")
    for pool in kuberay["pools"]:
        del pool["resources"]
    for args in (kuberay, anyscale):
        args["batch_jobs"] = {k: v for k, v in args["batch_jobs"].items() if k == "enabled"}
    assert anyscale == kuberay
