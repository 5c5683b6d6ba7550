"""The ingress deployment: OpenAI HTTP API in, a pool chosen per request, tokens out as SSE.

Thin glue: who may call is the gateway's, which pool is policies/', the
OpenAI shapes are openai_api's, metrics are telemetry's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, cast

from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from ray import serve
from ray.exceptions import RayTaskError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from deployments import schemas
from deployments.config import ApiKeyConfig, IngressConfig
from deployments.errors import ApiError, bad_request, context_length_exceeded, too_many_requests
from deployments.gateway import Gateway
from deployments.openai_api import (
    ChatEndpoint,
    CompletionEndpoint,
    Endpoint,
    parse_body,
    sampling_params,
)
from deployments.pool import ModelInfo, PoolRequest
from deployments.pool_monitor import PoolMonitor
from deployments.streaming import ChoiceProgress, merge_streams, usage
from deployments.telemetry import RequestRecord, Telemetry
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from policies.admission import should_shed
from policies.routing import RequestFeatures, choose_pool
from policies.tiers import Tier, resolve_tier

log = logging.getLogger(__name__)

Handler = Callable[[Request], Awaitable[Response]]


@dataclass
class Job:
    """An accepted request: where it runs, what it samples, and each choice's progress."""

    request_id: str
    key: ApiKeyConfig
    tier: Tier
    pool: str
    endpoint: Endpoint
    body: schemas.SamplingFields
    prompts: list[list[int]]
    params: SamplingParams
    choices: list[ChoiceProgress]

    @property
    def num_reserved_tokens(self) -> int:
        """What the request may cost at most: every choice's prompt plus max_tokens."""
        prompt = sum(len(self.prompts[c.prompt_index]) for c in self.choices)
        return prompt + self.params.max_tokens * len(self.choices)

    def pool_requests(self) -> list[PoolRequest]:
        """One engine request per choice; `n` copies of a seeded prompt get distinct seeds."""
        requests = []
        for index, choice in enumerate(self.choices):
            seed = None if self.params.seed is None else self.params.seed + index
            requests.append(
                PoolRequest(
                    request_id=f"{self.request_id}-{index}",
                    prompt_token_ids=self.prompts[choice.prompt_index],
                    params=replace(self.params, seed=seed),
                    priority=self.tier.priority,
                )
            )
        return requests


@serve.deployment
class Ingress:
    # Serve awaits an async constructor: the pools' tokenizer is fetched before traffic.
    async def __init__(  # type: ignore[misc]
        self, config: IngressConfig, pools: dict[str, DeploymentHandle]
    ) -> None:
        self._config = config
        self._pools = pools
        self._models: dict[str, ModelInfo] = {
            name: await handle.model_info.remote() for name, handle in pools.items()
        }
        # Pools of one family share a tokenizer; routing needs the token count first.
        self._tokenizer = next(iter(self._models.values())).tokenizer
        pool_configs = {p.name: p for p in config.pools}
        self._gateway = Gateway(config.gateway)
        self._monitor = PoolMonitor(pool_configs, pools, config.stats_poll_interval_s)
        self._telemetry = Telemetry(config.model_name, pool_configs, self._monitor)
        await self._monitor.poll_once()
        self._poller = asyncio.create_task(self._monitor.poll_forever())
        self._routes: dict[tuple[str, str], Handler] = {
            ("POST", "/v1/chat/completions"): lambda r: self._complete(r, ChatEndpoint),
            ("POST", "/v1/completions"): lambda r: self._complete(r, CompletionEndpoint),
            ("GET", "/v1/models"): self._list_models,
            ("GET", "/health"): self._health,
            ("GET", "/metrics"): self._metrics,
        }

    async def __call__(self, request: Request) -> Response:
        handler = self._routes.get((request.method, request.url.path))
        try:
            if handler is None:
                raise ApiError(
                    404, f"No route {request.method} {request.url.path}", code="not_found"
                )
            return await handler(request)
        except ApiError as error:
            return error.response()

    async def _list_models(self, request: Request) -> Response:
        card = schemas.ModelCard(id=self._config.model_name, created=0)
        return JSONResponse(schemas.ModelList(data=[card]).model_dump(mode="json"))

    async def _health(self, request: Request) -> Response:
        """503 while some pool has no live replica, so a load balancer routes elsewhere."""
        down = [name for name in self._pools if not self._monitor.replica_stats(name)]
        if down:
            return JSONResponse({"status": "degraded", "pools_down": down}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def _metrics(self, request: Request) -> Response:
        return Response(self._telemetry.render(), media_type=CONTENT_TYPE_LATEST)

    async def _complete(self, request: Request, endpoint_cls: type[Endpoint]) -> Response:
        start_s = time.monotonic()
        key = self._gateway.authenticate(request.headers.get("authorization"))
        body = parse_body(endpoint_cls.schema, await _read_json(request))
        if body.model != self._config.model_name:
            message = f"The model {body.model!r} does not exist."
            raise ApiError(404, message, code="model_not_found", param="model")
        job = self._plan(request, body, key, endpoint_cls, start_s)
        self._gateway.charge(key, job.num_reserved_tokens)
        events = self._run(job)
        headers = self._headers(job)
        if not body.stream:
            async for _ in events:
                pass
            return JSONResponse(
                job.endpoint.response(job.choices).model_dump(mode="json"), headers=headers
            )
        # Wait for the first delta so an engine-side rejection is still a 400, not a broken stream.
        first = await anext(events)
        return StreamingResponse(
            self._sse(job, _prepend(first, events)), media_type="text/event-stream", headers=headers
        )

    def _plan(
        self,
        request: Request,
        body: schemas.SamplingFields,
        key: ApiKeyConfig,
        endpoint_cls: type[Endpoint],
        start_s: float,
    ) -> Job:
        """Tier, prompts, pool and sampling for a request, or the 4xx that refuses it."""
        tier = self._tier(request, body, key)
        prompts = endpoint_cls.prompt_ids(body, self._tokenizer)
        if not all(prompts):
            raise bad_request("prompt must not be empty", param="prompt")
        longest = max(len(p) for p in prompts)
        loads = self._monitor.loads()
        pool = choose_pool(tier, RequestFeatures(longest, body.requested_max_tokens or 0), loads)
        if should_shed(tier, loads[pool]):
            retry_after_s = self._config.pool(pool).retry_after_s
            raise too_many_requests(
                f"Pool {pool!r} is at capacity for tier {tier.name!r}.", retry_after_s
            )
        max_tokens = self._max_tokens(body.requested_max_tokens, longest, pool)
        prefix = "chatcmpl" if endpoint_cls is ChatEndpoint else "cmpl"
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        choices = [
            ChoiceProgress(start_s=start_s, prompt_index=i)
            for i in range(len(prompts))
            for _ in range(body.n)
        ]
        return Job(
            request_id=request_id,
            key=key,
            tier=tier,
            pool=pool,
            endpoint=endpoint_cls(request_id, int(time.time()), body.model),
            body=body,
            prompts=prompts,
            params=sampling_params(body, max_tokens),
            choices=choices,
        )

    def _tier(self, request: Request, body: schemas.SamplingFields, key: ApiKeyConfig) -> Tier:
        names = [t.name for t in self._config.tiers]
        header = request.headers.get("x-sla-tier")
        try:
            name = resolve_tier(
                header, body.tier, key.default_tier, self._config.default_tier, names
            )
        except ValueError as error:
            raise bad_request(str(error), param="tier") from None
        return self._config.tier(name)

    def _max_tokens(self, requested: int | None, num_prompt_tokens: int, pool: str) -> int:
        """The request's max_tokens, by default the rest of the context, as vLLM does."""
        max_model_len = self._models[pool].max_model_len
        max_tokens = (
            requested if requested is not None else max(1, max_model_len - num_prompt_tokens)
        )
        if num_prompt_tokens + max_tokens > max_model_len:
            raise context_length_exceeded(num_prompt_tokens, max_tokens, max_model_len)
        return max_tokens

    async def _run(self, job: Job) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every choice's deltas as they arrive; leaving early cancels them in the pool."""
        handle = self._pools[job.pool].generate.options(stream=True)
        # With stream=True every call answers a generator; the stub can't tell.
        streams = [
            cast(DeploymentResponseGenerator, handle.remote(pool_request))
            for pool_request in job.pool_requests()
        ]
        status = "aborted"
        with self._monitor.in_flight(job.pool, len(streams)):
            try:
                async for index, output in merge_streams(streams):
                    job.choices[index].add(output, time.monotonic())
                    yield index, output
                status = "ok"
            except ValueError as error:  # the engine refused the input
                status = "error"
                raise bad_request(str(_cause(error))) from None
            except Exception:
                status = "error"
                raise
            finally:
                for stream in streams:
                    stream.cancel()
                self._telemetry.observe(self._record(job, status))

    async def _sse(
        self, job: Job, events: AsyncIterator[tuple[int, RequestOutput]]
    ) -> AsyncIterator[str]:
        """OpenAI's chunk stream; an error mid-stream is sent as an event, never a hang."""
        endpoint = job.endpoint
        try:
            for chunk in endpoint.opening(len(job.choices)):
                yield _event(chunk)
            async for index, output in events:
                finish_reason = output.finish_reason if output.finished else None
                if output.new_text or finish_reason:
                    yield _event(endpoint.delta(index, output.new_text, finish_reason))
            if job.body.include_usage_chunk:
                yield _event(endpoint.usage_chunk(usage(job.choices)))
        except ApiError as error:
            yield _event(schemas.ErrorResponse(error=error.detail))
        except Exception as error:
            log.exception("stream %s failed", job.request_id)
            detail = schemas.ErrorDetail(
                message=f"generation failed: {_cause(error)}", type="server_error"
            )
            yield _event(schemas.ErrorResponse(error=detail))
        yield "data: [DONE]\n\n"

    def _headers(self, job: Job) -> dict[str, str]:
        """Every response names where it went."""
        return {
            "x-tierserve-tier": job.tier.name,
            "x-tierserve-pool": job.pool,
            "x-tierserve-model": self._config.pool(job.pool).model_name,
        }

    def _record(self, job: Job, status: str) -> RequestRecord:
        prompt_text = self._tokenizer.decode(job.prompts[0]) if self._config.log_prompts else None
        return RequestRecord(
            request_id=job.request_id,
            key_name=job.key.name,
            tier=job.tier,
            pool=job.pool,
            status=status,
            choices=job.choices,
            end_s=time.monotonic(),
            prompt_text=prompt_text,
        )


async def _read_json(request: Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise bad_request("The request body is not valid JSON.") from None


def _event(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


async def _prepend(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    yield first
    async for item in rest:
        yield item


def _cause(error: BaseException) -> BaseException:
    """The replica's own exception inside Ray's wrapper, whose text is a whole traceback."""
    return error.cause if isinstance(error, RayTaskError) and error.cause else error
