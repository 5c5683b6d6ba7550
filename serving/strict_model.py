"""The base of every config model, and the checks several of them make."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """Base for config models: unknown keys are errors, instances are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def require_at_least(model: BaseModel, field: str, floor: str) -> None:
    """Raise ValueError unless `model.field >= model.floor`, naming both and their values."""
    value, floor_value = getattr(model, field), getattr(model, floor)
    if value < floor_value:
        raise ValueError(f"{field} ({value}) must be at least {floor} ({floor_value})")


def require_unique(kind: str, names: list[str]) -> None:
    """Raise ValueError naming the `kind` names that appear more than once."""
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"{kind} names must be unique; repeated: {duplicates}")
