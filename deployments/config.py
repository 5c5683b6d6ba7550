"""Config models the deployments read: pools, API keys, the gateway, the ingress.

Validated by pydantic at the YAML boundary (app.config.IngressConfig extends
IngressConfig with app-level settings), so a typo fails at `serve run`, not at
the first request. Engine settings reuse the engine's own `EngineConfig`
dataclass: one definition, one set of checks.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.config import EngineConfig
from policies.tiers import Tier


class _Strict(BaseModel):
    """Base for config models: unknown keys are errors, instances are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class AutoscalingSettings(_Strict):
    """The subset of Serve's autoscaling config a pool exposes."""

    min_replicas: int = Field(default=1, ge=1)
    max_replicas: int = Field(default=1, ge=1)
    target_ongoing_requests: float = Field(default=2, gt=0)


class PoolConfig(_Strict):
    """A pool: one engine per replica, tuned toward one end of the latency/throughput dial."""

    name: str
    model_name: str
    """The model this pool runs, as named in the `x-tierserve-model` header."""
    engine: EngineConfig = Field(default_factory=EngineConfig)
    num_replicas: int = Field(default=1, ge=1)
    """Fixed replica count; ignored when `autoscaling` is set."""
    autoscaling: AutoscalingSettings | None = None
    num_cpus: float = Field(default=0.0, ge=0)
    """CPUs reserved per replica in Ray; fractional or 0 lets small machines fit every pool."""
    num_gpus: float = Field(default=0.0, ge=0)
    max_queued_requests: int = Field(default=64, ge=0)
    """Requests allowed to wait beyond the running batch before the gateway sheds load."""
    max_request_tokens: int | None = Field(default=None, ge=1)
    """Prompt + max_tokens above which overflowing tiers prefer their overflow pool."""
    retry_after_s: int = Field(default=1, ge=1)
    """`Retry-After` sent with a 429 when this pool sheds load."""
    price_per_replica_hour: float = Field(default=0.0, ge=0)
    """Used for the cost-per-1k-output-tokens metric."""

    @property
    def max_replicas(self) -> int:
        return self.autoscaling.max_replicas if self.autoscaling else self.num_replicas


class ApiKeyConfig(_Strict):
    """A client key, its default tier and its rate limits (None means unlimited)."""

    key: str
    name: str
    """Shown in logs instead of the key itself."""
    default_tier: str | None = None
    requests_per_minute: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)
    """Counts prompt tokens plus the requested max_tokens."""


class GatewayConfig(_Strict):
    """Authentication and per-key limits at the ingress."""

    require_api_key: bool = False
    """Off for local runs; when on, unknown or missing keys get a 401."""
    api_keys: tuple[ApiKeyConfig, ...] = ()
    anonymous: ApiKeyConfig = ApiKeyConfig(key="", name="anonymous")
    """Limits and default tier for requests without a known key when keys are optional."""


class IngressConfig(_Strict):
    """What the ingress routes by: the public model, tiers, pools and the gateway."""

    model_name: str = "SmolLM2-135M-Instruct"
    """The public model id: `GET /v1/models` lists it and requests must name it."""
    default_tier: str = "standard"
    tiers: tuple[Tier, ...]
    pools: tuple[PoolConfig, ...]
    gateway: GatewayConfig = GatewayConfig()
    stats_poll_interval_s: float = Field(default=1.0, gt=0)
    """How often the ingress reads each pool's engine stats."""
    log_prompts: bool = False
    """Include prompt text in the per-request log line."""

    @model_validator(mode="after")
    def _check_references(self) -> IngressConfig:
        pools = {p.name for p in self.pools}
        tiers = {t.name for t in self.tiers}
        _require_unique("pool", [p.name for p in self.pools])
        _require_unique("tier", [t.name for t in self.tiers])
        for tier in self.tiers:
            for pool in (tier.pool, tier.overflow_pool):
                if pool is not None and pool not in pools:
                    raise ValueError(
                        f"tier {tier.name!r} names pool {pool!r}; pools: {sorted(pools)}"
                    )
        defaults = [self.default_tier, self.gateway.anonymous.default_tier]
        defaults += [k.default_tier for k in self.gateway.api_keys]
        for name in defaults:
            if name is not None and name not in tiers:
                raise ValueError(f"default tier {name!r} is not a tier; tiers: {sorted(tiers)}")
        return self

    def tier(self, name: str) -> Tier:
        return next(t for t in self.tiers if t.name == name)

    def pool(self, name: str) -> PoolConfig:
        return next(p for p in self.pools if p.name == name)


def _require_unique(kind: str, names: list[str]) -> None:
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"{kind} names must be unique; repeated: {duplicates}")
