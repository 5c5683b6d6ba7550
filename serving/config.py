"""Config models the deployments read: pools, tiers, request limits, batch jobs, the ingress.

Validated by pydantic at the YAML boundary (serving.app_config.IngressConfig extends
IngressConfig with app-level settings), so a typo fails at `serve run`, not at
the first request. Engine settings reuse the engine's own `EngineConfig`
dataclass: one definition, one set of checks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Self, TypeVar

from pydantic import Field, model_validator

from engine.config import EngineConfig
from policies.tiers import Tier
from serving.cache.config import SemanticCacheConfig
from serving.gateway_config import GatewayConfig
from serving.strict_model import StrictModel, require_at_least, require_unique


class AutoscalingSettings(StrictModel):
    """How a pool scales: replica bounds, per-replica engine-load targets, Serve's timing.

    The policy (serving/pools/scaling.py, policies/scaling.py) sizes the pool
    so each replica carries at most a full batch plus the target queue, and at
    most the target KV usage; Serve applies the delays and bounds.
    """

    min_replicas: int = Field(default=1, ge=1)
    max_replicas: int = Field(default=1, ge=1)
    target_num_waiting_per_replica: float = Field(default=2, ge=0)
    """Sequences allowed to queue in each replica's engine beyond its full batch."""
    target_kv_cache_usage: float = Field(default=0.8, gt=0, le=1)
    """KV usage each replica should stay under, leaving room before the engine preempts."""
    upscale_delay_s: float = Field(default=10.0, ge=0)
    """How long the policy must keep asking for more replicas before Serve adds them."""
    downscale_delay_s: float = Field(default=120.0, ge=0)
    """How long the policy must keep asking for fewer replicas before Serve removes one."""
    metrics_interval_s: float = Field(default=2.0, gt=0)
    """How often each replica samples and reports its engine load (Serve's default is 10 s)."""
    look_back_period_s: float = Field(default=10.0, gt=0)
    """The window each replica's reported load is averaged over."""

    @model_validator(mode="after")
    def _check_bounds(self) -> AutoscalingSettings:
        require_at_least(self, "max_replicas", "min_replicas")
        return self


class ReplicaChoiceSettings(StrictModel):
    """How a pool's replica choice (a Serve request router, serving/pools/replica_choice.py)
    picks a replica."""

    enabled: bool = True
    """Off, Serve's default power-of-two choice picks the replica."""

    stats_period_s: float = Field(default=1.0, gt=0)
    """How often Serve reads each replica's engine load for routing (Serve's default is 10 s)."""
    kv_cache_full: float = Field(default=0.95, gt=0, le=1)
    """KV usage at which a replica counts as full even with free batch slots."""
    affinity_blocks: int = Field(default=4, ge=0)
    """Leading KV blocks of a prompt that key prefix-cache affinity; 0 turns affinity off."""
    affinity_max_imbalance: float = Field(default=0.5, ge=0)
    """How much busier (fraction of batch or KV in use) than the least loaded replica the
    replica holding a prompt's prefix may be and still get the prompt."""
    max_prefixes: int = Field(default=4096, ge=1)
    """Prefixes each chooser remembers the replica of (least recently used dropped first)."""


class PoolConfig(StrictModel):
    """A pool: one engine per replica, tuned toward one end of the latency/throughput dial."""

    name: str
    model_name: str
    """The model this pool runs, as named in the `x-tierserve-model` header."""
    engine: EngineConfig = Field(default_factory=EngineConfig)
    num_replicas: int = Field(default=1, ge=1)
    """Fixed replica count; ignored when `autoscaling` is set."""
    autoscaling: AutoscalingSettings | None = None
    replica_choice: ReplicaChoiceSettings = ReplicaChoiceSettings()
    """Replica choice inside the pool: load, KV headroom and prefix-cache affinity."""
    num_cpus: float = Field(default=0.0, ge=0)
    """CPUs reserved per replica in Ray; fractional or 0 lets small machines fit every pool."""
    num_gpus: float = Field(default=0.0, ge=0)
    max_queued_requests: int = Field(default=64, ge=0)
    """Requests allowed to wait beyond the running batch before the gateway sheds load."""
    max_request_tokens: int | None = Field(default=None, ge=1)
    """Prompt + max_tokens above which overflowing tiers prefer their overflow pool."""
    price_per_replica_hour: float = Field(default=0.0, ge=0)
    """Used for the cost-per-1k-output-tokens metric."""
    cost_per_1k_tokens: float | None = Field(default=None, ge=0)
    """Output cost per 1k tokens at the chosen batch, written by bench/serving/sweep.py; placement
    sends a request to the cheapest pool predicted to meet its SLO."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources each replica needs (e.g. {"pool_offline": 1}): pins the pool to
    the nodes or worker group that carry them."""
    distill_if_missing: bool = False
    """For a pool of `model: student`: when no student has been distilled yet, the replica
    starts one in the background (`tierserve distill`, at low CPU priority) and serves
    once it is published. Until then the pool reports itself unavailable."""

    @model_validator(mode="after")
    def _check_tensor_parallel_reserves_its_ranks(self) -> PoolConfig:
        if self.engine.tensor_parallel_size > 1 and self.num_cpus <= 0:
            raise ValueError(
                f"pool {self.name!r}: engine.tensor_parallel_size "
                f"{self.engine.tensor_parallel_size} needs num_cpus > 0, reserved for each rank "
                "(the replica's placement group has one bundle per rank)"
            )
        return self

    @property
    def max_replicas(self) -> int:
        """The most replicas this pool may run."""
        return self.autoscaling.max_replicas if self.autoscaling else self.num_replicas

    @property
    def estimated_cost_per_1k_tokens(self) -> float:
        """`cost_per_1k_tokens` as measured by bench/serving/sweep.py, else a proxy that ranks pools
        the same way: the price of one batch slot for an hour."""
        if self.cost_per_1k_tokens is not None:
            return self.cost_per_1k_tokens
        return self.price_per_replica_hour / self.engine.max_num_seqs


class RequestLimits(StrictModel):
    """The most one request may ask for: bounds that keep one caller from stalling the rest."""

    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    """Larger bodies get a 413 before they are parsed."""
    max_json_depth: int = Field(default=32, ge=4)
    """Deeper nesting is refused with a 400 (a few levels suffice for any real request)."""
    max_prompts: int = Field(default=32, ge=1)
    """Prompts in one text-completion request."""
    max_sequences: int = Field(default=64, ge=1)
    """n x prompts: the sequences one request may start."""
    max_embedding_inputs: int = Field(default=256, ge=1)
    """Inputs in one /v1/embeddings request (OpenAI allows 2,048; each is a sequence)."""
    max_stop_strings: int = Field(default=8, ge=0)
    max_stop_chars: int = Field(default=256, ge=1)
    """Length of each stop string."""


class BatchJobsConfig(StrictModel):
    """The Files and Batches APIs and the runner that feeds their lines to a pool."""

    enabled: bool = True
    data_dir: str = "~/.cache/tierserve/batches"
    """Where files and job state live (SQLite): a persistent volume on KubeRay, so a
    restarted runner resumes its jobs."""
    tier: str = "batch"
    """The tier every line runs at: its pool, its priority, its deadline."""
    max_in_flight: int = Field(default=96, ge=1)
    """Lines in flight at once: enough to keep the pool's batch full and its queue fed."""
    max_file_bytes: int = Field(default=100 * 1024 * 1024, ge=1024)
    """Uploads over this are refused (413)."""
    max_lines: int = Field(default=50_000, ge=1)
    """Lines in one batch's input file (OpenAI's limit)."""
    retry_delay_s: float = Field(default=1.0, gt=0)
    """How long a line refused for load (429, 503) waits before it is sent again."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources the runner's replica needs: on a cluster, one only the node
    holding data_dir's volume offers, so a restarted runner finds its store."""


class SmallModelConfig(StrictModel):
    """The small model and how requests reach it (policies/model_routing.py)."""

    pool: str
    """The pool serving the small model; no tier names it, requests reach it by model."""
    router_file: Path = Path("configs/router.json")
    """The fallback difficulty router, read when the app is built (relative paths are from
    the directory `serve run` starts in): used only for the student it was fitted to, when
    that student has no router of its own beside it (policies/router_choice.py)."""


class IngressConfig(StrictModel):
    """What the ingress routes by: the public model, tiers, pools and the gateway."""

    model_name: str = "SmolLM2-135M-Instruct"
    """The default model's public id: `GET /v1/models` lists it (with the small model's,
    if any) and requests name it, the small model, or `auto`."""
    default_tier: str = "standard"
    tiers: tuple[Tier, ...]
    pools: tuple[PoolConfig, ...]
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    limits: RequestLimits = RequestLimits()
    request_timeout_s: float = Field(default=900.0, gt=0)
    """No request runs longer than this, whatever its tier's deadline (408 past it)."""
    stats_poll_interval_s: float = Field(default=1.0, gt=0)
    """How often the ingress reads each pool's engine stats."""
    log_prompts: bool = False
    """Include prompt text in the per-request log line."""
    batch_jobs: BatchJobsConfig = BatchJobsConfig()
    small_model: SmallModelConfig | None = None
    """Easy `model: auto` requests of tiers with `difficulty_routing` go to this model."""
    semantic_cache: SemanticCacheConfig = SemanticCacheConfig()

    @model_validator(mode="after")
    def _check_references(self) -> IngressConfig:
        require_unique("pool", [p.name for p in self.pools])
        require_unique("tier", [t.name for t in self.tiers])
        self._check_pool_references()
        self._check_tier_references()
        self._check_small_model()
        for tier in self.tiers:
            if tier.deadline_s is not None and tier.deadline_s > self.request_timeout_s:
                raise ValueError(
                    f"tier {tier.name!r} deadline_s {tier.deadline_s} exceeds "
                    f"request_timeout_s {self.request_timeout_s}"
                )
        return self

    def _check_pool_references(self) -> None:
        """Every field that names a pool names one this config has: a typo (or a pool a
        copied config dropped) fails at load, not in a replica's start-up."""
        pools = sorted(p.name for p in self.pools)
        references = [
            (f"tiers[{t.name}].{field}", getattr(t, field))
            for t in self.tiers
            for field in ("pool", "overflow_pool")
        ]
        if self.small_model is not None:
            references.append(("small_model.pool", self.small_model.pool))
        references.append(("semantic_cache.embedding_pool", self.semantic_cache.embedding_pool))
        for field, name in references:
            if name is not None and name not in pools:
                raise ValueError(f"{field} {name!r} is not a pool; pools: {pools}")
        for pool in self.pools:
            self._check_draft_model(pool)

    def _check_draft_model(self, pool: PoolConfig) -> None:
        """A draft model is an engine model ('default', 'student', a file or a folder); one
        named like a pool, or by a pool's public model name, would only fail in the
        replica, as a missing folder. Say which engine model that pool runs instead."""
        spec = pool.engine.spec_decode
        if spec is None or spec.method != "draft" or spec.draft_model is None:
            return
        named = [p for p in self.pools if spec.draft_model in (p.name, p.model_name)]
        if named and spec.draft_model != named[0].engine.model:
            raise ValueError(
                f"pools[{pool.name}].engine.spec_decode.draft_model {spec.draft_model!r} "
                f"names pool {named[0].name!r}, not a model: use its engine model "
                f"{named[0].engine.model!r} (a draft model is 'default', 'student', a .gguf "
                f"file or an HF folder); pools: {sorted(p.name for p in self.pools)}"
            )

    def _check_tier_references(self) -> None:
        """Default tiers, keys' allowed tiers and the batch jobs' tier exist."""
        tiers = sorted(t.name for t in self.tiers)
        keys = [self.gateway.anonymous, *self.gateway.api_keys]
        references = [
            ("default_tier", self.default_tier),
            ("batch_jobs.tier", self.batch_jobs.tier),
            *(("semantic_cache.tiers", name) for name in self.semantic_cache.tiers),
            *((f"API key {k.name!r} default_tier", k.default_tier) for k in keys),
        ]
        for field, name in references:
            if name is not None and name not in tiers:
                raise ValueError(f"{field} {name!r} is not a tier; tiers: {tiers}")
        for key in keys:
            unknown = sorted(set(key.allowed_tiers or ()) - set(tiers))
            if unknown:
                raise ValueError(
                    f"API key {key.name!r} allows unknown tiers {unknown}; tiers: {tiers}"
                )

    def _check_small_model(self) -> None:
        """The small pool is its own (no tier's) and serves a model other than the default."""
        if self.small_model is None:
            return
        name = self.small_model.pool
        if any(name in (t.pool, t.overflow_pool) for t in self.tiers):
            raise ValueError(f"small_model.pool {name!r} must not be a tier's pool")
        if self.pool(name).model_name == self.model_name:
            raise ValueError(f"the small pool {name!r} must serve a model other than the default")

    @property
    def embedding_pool(self) -> str:
        """The pool the semantic cache embeds with (SemanticCacheConfig.embedding_pool)."""
        if self.semantic_cache.embedding_pool is not None:
            return self.semantic_cache.embedding_pool
        if self.small_model is not None:
            return self.small_model.pool
        return self.tier(self.default_tier).pool

    def tier(self, name: str) -> Tier:
        """The tier called `name`; KeyError naming the tiers there are."""
        return _named("tier", self.tiers, name)

    def pool(self, name: str) -> PoolConfig:
        """The pool called `name`; KeyError naming the pools there are."""
        return _named("pool", self.pools, name)

    def with_slos_scaled(self, factor: float) -> Self:
        """A copy whose tiers' TTFT and TPOT targets are multiplied by `factor`: SLOs set on
        one machine, scaled to a slower one (bench_sla, the real-model test apps)."""
        tiers = tuple(
            t.model_copy(update={"ttft_ms": t.ttft_ms * factor, "tpot_ms": t.tpot_ms * factor})
            for t in self.tiers
        )
        return self.with_changes(tiers=tiers)

    def with_changes(self, **changes: object) -> Self:
        """A copy with `changes`, validated again. pydantic's `model_copy(update=...)` skips
        validation: bench_sla's shared-pool copy kept `small_model.pool` naming a pool it had
        dropped, and every ingress replica died at start."""
        return self.model_validate({**dict(self), **changes})


_Named = TypeVar("_Named", Tier, PoolConfig)


def _named(kind: str, items: tuple[_Named, ...], name: str) -> _Named:
    """The item called `name`. A KeyError, not the StopIteration of a bare `next()`, which an
    async caller (the ingress's constructor) turns into an anonymous RuntimeError."""
    for item in items:
        if item.name == name:
            return item
    raise KeyError(f"no {kind} {name!r}; {kind}s: {sorted(i.name for i in items)}")
