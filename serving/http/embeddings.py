"""`POST /v1/embeddings`: inputs tokenized here, embedded by a pool's engine at the tier.

Each input is one prefill-only sequence in the pool's engine (engine/pooling.py), sent
at its tier's priority beside the generations there, so embeddings share the batch,
the scheduler's chunking and its priorities instead of a model of their own. The
pool is the tier's (its overflow pool when the tier's own has no live replica), or the
small pool when the request names the small model. The semantic cache
(serving/cache/) embeds conversations through `embed` too.
"""

from __future__ import annotations

import asyncio
import base64
import math
from typing import Any, cast

import numpy as np
from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle, DeploymentResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.outputs import RequestOutput
from engine.sampling_params import MEAN_POOLING, PoolingParams
from policies.model_routing import AUTO_MODEL
from policies.tiers import Tier
from serving.config import IngressConfig
from serving.http import embedding_schemas as es
from serving.http.errors import (
    ApiError,
    bad_request,
    deadline_exceeded,
    pool_unavailable,
    replica_unavailable,
)
from serving.http.gateway import Gateway
from serving.http.openai_api import parse_body
from serving.http.planner import Planner
from serving.http.request_body import decode_json_object, read_body
from serving.http.routes import Call, Route
from serving.pools.pool import NewEmbedding
from serving.pools.pool_monitor import PoolMonitor


class EmbeddingsApi:
    """The embeddings route, and `embed` for the ingress's own uses (the semantic cache)."""

    def __init__(
        self,
        config: IngressConfig,
        pools: dict[str, DeploymentHandle],
        planner: Planner,
        gateway: Gateway,
        monitor: PoolMonitor,
        tokenizer: Any,
    ) -> None:
        self._config = config
        self._pools = pools
        self._planner = planner
        self._gateway = gateway
        self._monitor = monitor
        self._tokenizer = tokenizer

    def routes(self) -> dict[tuple[str, str], Route]:
        """The one route this serves."""
        return {("POST", "/v1/embeddings"): Route(self._embeddings)}

    async def _embeddings(self, request: Request, call: Call) -> Response:
        limits = self._config.limits
        raw = await read_body(request, limits.max_body_bytes)
        document = await asyncio.to_thread(decode_json_object, raw, limits.max_json_depth)
        body: es.EmbeddingRequest = parse_body(es.EmbeddingRequest, document)
        tier = self._planner.tier(request.headers.get("x-sla-tier"), body, call.caller)
        pool = self.pool_for(body.model, tier)
        prompts = await asyncio.to_thread(self._token_ids, body, pool)
        num_tokens = sum(len(p) for p in prompts)
        self._gateway.charge(call.caller, len(prompts), num_tokens)
        timeout_s = min(tier.deadline_s or math.inf, self._config.request_timeout_s)
        outputs = await self.embed(pool, prompts, tier.priority, call.request_id, timeout_s)
        response = es.EmbeddingResponse(
            data=[
                es.Embedding(index=i, embedding=_encoded(o.embedding or [], body.encoding_format))
                for i, o in enumerate(outputs)
            ],
            model=self._config.pool(pool).model_name,
            usage=es.EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )
        headers = {"x-tierserve-tier": tier.name, "x-tierserve-pool": pool}
        return JSONResponse(response.model_dump(mode="json"), headers=headers)

    def pool_for(self, model: str, tier: Tier) -> str:
        """The pool that embeds for `model` at `tier`: the small pool for the small model,
        else the tier's pool, or its overflow pool while the tier's own has no replica."""
        if model not in self._planner.model_names or model == AUTO_MODEL:
            names = [n for n in self._planner.model_names if n != AUTO_MODEL]
            message = f"The model {model!r} does not embed here; use one of {names}."
            raise ApiError(404, message, code="model_not_found", param="model")
        small = self._config.small_model
        if small is not None and model == self._config.pool(small.pool).model_name:
            candidates = [small.pool]
        else:
            candidates = [p for p in (tier.pool, tier.overflow_pool) if p is not None]
        for pool in candidates:
            if self._monitor.replica_stats(pool):
                return pool
        raise pool_unavailable(tier.name, 1)

    def _token_ids(self, body: es.EmbeddingRequest, pool: str) -> list[list[int]]:
        """Each input's token ids, within the request and context limits (400s naming
        `input`)."""
        limit = self._config.limits.max_embedding_inputs
        if len(body.input) > limit:
            raise bad_request(f"input has {len(body.input)} items; at most {limit}.", "input")
        vocab = len(self._tokenizer)
        max_len = self._monitor.max_model_len(pool)
        prompts = []
        for i, item in enumerate(body.input):
            ids = self._tokenizer.encode(item) if isinstance(item, str) else list(item)
            if any(t >= vocab for t in ids):
                raise bad_request(f"input[{i}]: token ids must be below {vocab}.", "input")
            if not ids or len(ids) >= max_len:
                message = f"input[{i}] has {len(ids)} tokens; it must have 1 to {max_len - 1}."
                raise bad_request(message, "input", code="context_length_exceeded")
            prompts.append(ids)
        return prompts

    async def embed(
        self, pool: str, prompts: list[list[int]], priority: int, request_id: str,
        timeout_s: float, pooling: PoolingParams = MEAN_POOLING,
    ) -> list[RequestOutput]:  # fmt: skip
        """Every prompt embedded at once on `pool` (they share the engine's batch); the
        OpenAI error for a refusal, a lost replica or the deadline."""
        handle = self._pools[pool].embed
        sent = [
            NewEmbedding(f"emb-{request_id}-{i}", p, priority, pooling)
            for i, p in enumerate(prompts)
        ]
        calls = [cast(DeploymentResponse, handle.remote(new)) for new in sent]
        try:
            async with asyncio.timeout(timeout_s):
                return list(await asyncio.gather(*calls))
        except TimeoutError:
            raise deadline_exceeded(timeout_s) from None
        except ValueError as error:  # the engine refused the input
            raise bad_request(str(getattr(error, "cause", None) or error), "input") from None
        except RayActorError:
            raise replica_unavailable() from None
        finally:
            for call in calls:
                call.cancel()


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """OpenAI's encodings: the numbers, or base64 of their little-endian float32 bytes."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
