"""The semantic cache's settings (the `semantic_cache` block of the config file)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SemanticCacheConfig(BaseModel):
    """The semantic cache at the ingress (serving/cache/, docs/semantic_cache.md): a chat
    request whose last turn means what a stored one meant, under the same model, sampling,
    tools, format and earlier turns, is answered with the stored answer at once."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    tiers: tuple[str, ...] = ("standard", "batch")
    """Tiers whose requests use it. Not interactive by default: its users chat, so the
    same words rarely mean the same thing twice, and a wrong answer costs more than the
    few hundred milliseconds a hit saves; standard and batch traffic repeats itself
    (FAQ-style questions, re-run jobs) and waits longer for a generation."""
    threshold: float = Field(default=0.95, gt=0, le=1)
    """Cosine similarity at or above which a stored answer is returned (`tierserve cache
    calibrate` writes it)."""
    max_entries: int = Field(default=4096, ge=1)
    max_bytes: int = Field(default=64 * 2**20, ge=1024)
    """Vectors plus answers; the least recently used entries go first past either bound."""
    ttl_s: float = Field(default=3600.0, gt=0)
    """An entry older than this is never returned."""
    embedding_pool: str | None = None
    """The pool that embeds conversations; None: the small pool when configured, else the
    default tier's pool. Its model is part of every key: vectors of two models never meet."""
    backend: Literal["memory", "redis"] = "memory"
    """`memory`: each ingress replica its own; `redis`: shared by every replica."""
    redis_url: str | None = None
    """redis://host:port/db, for the redis backend."""
    namespace: str = "tierserve:semantic-cache"
    """Prefix of every Redis key, so several apps can share one server."""
    check_fraction: float = Field(default=0.0, ge=0, le=1)
    """Share of hits also generated in the background at the batch tier and compared with
    the stored answer (`tierserve:semantic_cache_false_hit_checks`)."""

    @model_validator(mode="after")
    def _redis_needs_a_url(self) -> SemanticCacheConfig:
        if self.backend == "redis" and not self.redis_url:
            raise ValueError("semantic_cache.backend redis needs semantic_cache.redis_url")
        return self
