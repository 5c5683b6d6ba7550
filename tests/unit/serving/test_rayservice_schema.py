"""configs/kuberay/rayservice.yaml against the RayService CRD's own schema (the
openAPIV3Schema of KubeRay v1.7.0's ray.io_rayservices.yaml, descriptions removed,
vendored in tests/data/kuberay), as strictly as `kubectl apply` validates by default: a
field the schema does not list is an error, where the API server would silently drop it."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from jsonschema import Draft7Validator

from bench.paths import CONFIGS_DIR, REPO_ROOT

SCHEMA_FILE = REPO_ROOT / "tests" / "data" / "kuberay" / "rayservice_v1.schema.json"
SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf")


def strict(schema: Any) -> Any:
    """The schema with `additionalProperties: false` wherever it lists an object's fields and
    neither allows others nor keeps unknown fields (`x-kubernetes-preserve-unknown-fields`)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {name: strict(s) for name, s in out["properties"].items()}
        if "additionalProperties" not in out and not out.get(
            "x-kubernetes-preserve-unknown-fields"
        ):
            out["additionalProperties"] = False
    for keyword in ("items", "additionalProperties"):
        if isinstance(out.get(keyword), dict):
            out[keyword] = strict(out[keyword])
    for keyword in SUBSCHEMA_LISTS:
        if keyword in out:
            out[keyword] = [strict(s) for s in out[keyword]]
    return out


@pytest.fixture(scope="module")
def validator() -> Draft7Validator:
    return Draft7Validator(strict(json.loads(SCHEMA_FILE.read_text())))


def rayservice() -> dict[str, Any]:
    return yaml.safe_load((CONFIGS_DIR / "kuberay" / "rayservice.yaml").read_text())


def errors(validator: Draft7Validator, document: dict[str, Any]) -> list[str]:
    """Each validation error as `path: message`."""
    return [
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
        for e in validator.iter_errors(document)
    ]


def test_the_rayservice_is_valid_under_kuberays_schema(validator: Draft7Validator) -> None:
    assert errors(validator, rayservice()) == []


def test_a_misspelt_field_is_refused(validator: Draft7Validator) -> None:
    document = rayservice()
    cluster = document["spec"]["rayClusterConfig"]
    cluster["enableInTreeAutoscaler"] = cluster.pop("enableInTreeAutoscaling")
    [error] = errors(validator, document)
    assert error.startswith("spec.rayClusterConfig: Additional properties are not allowed")
    assert "'enableInTreeAutoscaler' was unexpected" in error


def test_a_field_of_the_wrong_type_is_refused(validator: Draft7Validator) -> None:
    document = rayservice()
    document["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] = "yes"
    [error] = errors(validator, document)
    assert error.startswith("spec.rayClusterConfig.enableInTreeAutoscaling: 'yes'")


def test_strict_keeps_fields_open_where_the_schema_keeps_them() -> None:
    schema = {
        "type": "object",
        "properties": {
            "fixed": {"type": "object", "properties": {"a": {"type": "string"}}},
            "open": {
                "type": "object",
                "x-kubernetes-preserve-unknown-fields": True,
                "properties": {"a": {"type": "string"}},
            },  # fmt: skip
            "map": {"type": "object", "additionalProperties": {"type": "string"}},
        },
    }
    validator = Draft7Validator(strict(schema))
    assert validator.is_valid({"open": {"b": 1}, "map": {"any": "x"}})
    assert not validator.is_valid({"fixed": {"b": "x"}})
    assert not validator.is_valid({"other": 1})
