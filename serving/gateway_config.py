"""The gateway's config: who may call, with which key, at which tiers and rates."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field, model_validator

from serving.strict_model import StrictModel, require_unique


class CallerPolicy(StrictModel):
    """What a caller may do: its default tier, the tiers it may use and its rate limits
    (None means unlimited). Anonymous callers get one of these; keys extend it."""

    name: str
    """Shown in logs and errors instead of the key itself."""
    default_tier: str | None = None
    allowed_tiers: tuple[str, ...] | None = None
    """Tiers this caller may ask for (403 otherwise); None allows every tier."""
    requests_per_minute: int | None = Field(default=None, ge=1)
    """Counts sequences (prompts x n), not HTTP requests."""
    tokens_per_minute: int | None = Field(default=None, ge=1)
    """Counts prompt tokens plus the requested max_tokens of every sequence."""

    @model_validator(mode="after")
    def _check_default_is_allowed(self) -> CallerPolicy:
        if self.default_tier is not None and not self.may_use(self.default_tier):
            raise ValueError(
                f"{self.name!r}: default_tier {self.default_tier!r} "
                f"is not in allowed_tiers {list(self.allowed_tiers or ())}"
            )
        return self

    def may_use(self, tier: str) -> bool:
        """Whether this caller may ask for `tier`."""
        return self.allowed_tiers is None or tier in self.allowed_tiers


class ApiKeyConfig(CallerPolicy):
    """A client key and its policy. The key comes from exactly one source: inline `key`,
    the environment variable `key_env`, or the file `key_file` (a mounted Kubernetes
    Secret). Env vars and files are read by the ingress replica, where they exist."""

    key: str | None = Field(default=None, repr=False)
    key_env: str | None = None
    key_file: str | None = None

    @model_validator(mode="after")
    def _check_source(self) -> ApiKeyConfig:
        sources = [s for s in (self.key, self.key_env, self.key_file) if s is not None]
        if len(sources) != 1:
            raise ValueError(f"API key {self.name!r} needs exactly one of key, key_env, key_file")
        if self.key is not None and not self.key.strip():
            raise ValueError(f"API key {self.name!r} is empty")
        return self

    def read_key(self) -> str:
        """The key's text from its source; ValueError when the source is missing or empty."""
        if self.key is not None:
            text = self.key
        elif self.key_env is not None:
            text = os.environ.get(self.key_env, "")
        else:
            path = Path(self.key_file or "")
            if not path.is_file():
                raise ValueError(f"API key {self.name!r}: key_file {str(path)!r} does not exist")
            text = path.read_text()
        text = text.strip()  # Secret files and env files often end with a newline
        if not text:
            source = "key" if self.key is not None else self.key_env or self.key_file
            raise ValueError(f"API key {self.name!r} is empty (source: {source})")
        return text


class GatewayConfig(StrictModel):
    """Authentication and per-key limits at the ingress."""

    require_api_key: bool = False
    """Off for local runs; when on, unknown or missing keys get a 401 on every route
    but /health."""
    api_keys: tuple[ApiKeyConfig, ...] = ()
    anonymous: CallerPolicy = CallerPolicy(name="anonymous")
    """Limits and tiers for requests without a known key when keys are optional."""

    @model_validator(mode="after")
    def _check_names(self) -> GatewayConfig:
        require_unique("API key", [k.name for k in self.api_keys])
        return self
