"""The semantic cache as the ingress builds it: its store, and how it embeds a question (the
embedding pool's engine, through the embeddings route's own `embed`, framed and pooled as
serving/cache/question_embedding.py says)."""

from __future__ import annotations

from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from serving.cache.entries import CacheStore, StoreBounds
from serving.cache.memory_store import MemoryStore
from serving.cache.question_embedding import POOLING, question_prompt
from serving.cache.redis_store import RedisStore
from serving.cache.semantic_cache import SemanticCache, Verify
from serving.config import IngressConfig
from serving.http.embeddings import EmbeddingsApi


def build_cache(
    config: IngressConfig,
    embeddings: EmbeddingsApi,
    tokenizer: Any,
    registry: CollectorRegistry,
    verify: Verify,
) -> SemanticCache:
    """The configured cache (an unused one when disabled: it answers `query` with None)."""
    settings = config.semantic_cache
    pool = config.embedding_pool
    embedding_model = config.pool(pool).model_name

    async def embed(text: str, priority: int, request_id: str) -> np.ndarray:
        """The question's embedding on the embedding pool, at the request's priority."""
        ids = tokenizer.encode(question_prompt(text))
        timeout_s = min(config.request_timeout_s, 60.0)
        [output] = await embeddings.embed(
            pool, [ids], priority, f"cache-{request_id}", timeout_s, POOLING
        )
        return np.asarray(output.embedding, dtype=np.float32)

    return SemanticCache(settings, embedding_model, embed, _store(config), registry, verify)


def _store(config: IngressConfig) -> CacheStore:
    settings = config.semantic_cache
    bounds = StoreBounds(settings.max_entries, settings.max_bytes, settings.ttl_s)
    if settings.backend == "redis":
        assert settings.redis_url is not None  # the config requires it
        return RedisStore(settings.redis_url, settings.namespace, bounds)
    return MemoryStore(bounds)
