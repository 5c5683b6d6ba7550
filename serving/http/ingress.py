"""The ingress deployment: OpenAI HTTP API in, a pool chosen per request, tokens out as SSE.

Thin glue: who may call is the gateway's, which pool is the planner's (over
policies/), running the accepted request on its pool and logging it answers',
the OpenAI shapes are openai_api's, the SSE framing sse's, models,
health and metrics service_routes' and telemetry's. Every answer is
OpenAI-format JSON (or, once a stream has begun, an SSE error event then
`[DONE]`): refusals carry their status, and anything unexpected is a 500 with
the request id while the traceback goes to the replica log.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from functools import partial
from typing import Any, cast

from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from policies.difficulty import DifficultyModel
from serving.batch.api import BatchApi
from serving.cache.semantic_cache import Lookup
from serving.cache.wiring import build_cache
from serving.config import IngressConfig
from serving.gateway_config import CallerPolicy
from serving.http.accepted import AcceptedRequest
from serving.http.answers import Answers
from serving.http.embeddings import EmbeddingsApi
from serving.http.errors import (
    ApiError,
    internal_error,
)
from serving.http.gateway import Gateway
from serving.http.limits import check_limits
from serving.http.openai_api import (
    ENDPOINTS,
    Endpoint,
    parse_body,
)
from serving.http.planner import Planner
from serving.http.request_body import read_json_object
from serving.http.routes import Call, Route, RouteTable
from serving.http.service_routes import ServiceRoutes
from serving.http.sse import prepend, sse_stream
from serving.http.student_router import StudentRouter
from serving.pools.calls import first_answer
from serving.pools.pool_monitor import PoolMonitor, serve_running_replicas
from serving.pools.slo_watch import SloWatch
from serving.telemetry import Admission, Telemetry

log = logging.getLogger(__name__)

MAX_USER_CHARS = 256
"""The body's `user` is logged up to this length: an id, not a way to fill the log."""
BATCH_RUNNER = CallerPolicy(name="batch-runner")
"""The caller batch lines run as: the batch's creator was checked for the tier when it
was created, and the runner's in-flight bound, not a rate limit, paces its lines."""


@serve.deployment
class Ingress:
    """The OpenAI-compatible front door: authenticates, validates, picks a tier and a pool,
    streams the pool's tokens back, and answers every failure in OpenAI's error format."""

    # Serve awaits an async constructor: the pools' tokenizer is fetched before traffic.
    async def __init__(  # type: ignore[misc]
        self,
        config: IngressConfig,
        pools: dict[str, DeploymentHandle],
        batch_runner: DeploymentHandle | None = None,
        router: DifficultyModel | None = None,
    ) -> None:
        """`router` is the configured one: the fallback of serving/http/student_router.py."""
        self._config = config
        self._pools = pools
        self._tokenizer = await _default_model_tokenizer(config, pools)
        pool_configs = {p.name: p for p in config.pools}
        self._gateway = Gateway(config.gateway)
        self._monitor = PoolMonitor(
            pool_configs, pools, config.stats_poll_interval_s, serve_running_replicas(pools)
        )
        self._telemetry = Telemetry(config.model_name, pool_configs, self._monitor)
        small = config.small_model
        self._router = None if small is None else StudentRouter(small.pool, router, self._monitor)
        self._planner = Planner(
            config, self._router, self._gateway, self._monitor, self._telemetry, self._tokenizer
        )
        await self._monitor.poll_once()
        self._poller = asyncio.create_task(self._monitor.poll_forever())
        self._slo_watch = SloWatch(config.tiers, self._monitor)
        self._slo_watch.check()
        self._telemetry.registry.register(self._slo_watch)
        self._slo_watcher = asyncio.create_task(self._slo_watch.watch_forever())
        self.embeddings = EmbeddingsApi(
            config, pools, self._planner, self._gateway, self._monitor, self._tokenizer
        )
        verify = partial(self.run_batch_line, "/v1/chat/completions")  # false-hit checks
        self._cache = build_cache(
            config, self.embeddings, self._tokenizer, self._telemetry.registry, verify
        )
        await self._cache.sync()  # a shared store's entries, indexed before traffic
        self._answers = Answers(
            pools, self._monitor, self._telemetry, self._cache, self._tokenizer, config.log_prompts
        )
        self._routes = self._route_table(batch_runner)

    def _route_table(self, batch_runner: DeploymentHandle | None) -> RouteTable:
        """The OpenAI routes, health and metrics, and the Batch API's when it runs."""
        config = self._config
        routes: dict[tuple[str, str], Route] = {
            **{
                ("POST", path): Route(partial(self._complete, endpoint=endpoint))
                for path, endpoint in ENDPOINTS.items()
            },
            **ServiceRoutes(
                self._planner.model_names,
                config.pools,
                self._monitor,
                self._slo_watch,
                self._telemetry,
                self._router,
            ).routes(),
        }
        routes.update(self.embeddings.routes())
        if batch_runner is not None:
            batches = BatchApi(
                batch_runner, config.batch_jobs, self._gateway, config.limits.max_json_depth
            )
            routes.update(batches.routes())
        return RouteTable(routes)

    async def __call__(self, request: Request) -> Response:
        """Answer one HTTP call; whatever happens, the answer is OpenAI-format JSON or SSE
        and names the request id (`x-tierserve-request-id`) the replica log knows it by."""
        request_id = uuid.uuid4().hex
        try:
            response = await self._dispatch(request, request_id)
        except ApiError as error:
            response = error.response()
        except Exception:
            log.exception("request %s failed", request_id)
            response = internal_error(request_id).response()
        response.headers["x-tierserve-request-id"] = request_id
        return response

    async def _dispatch(self, request: Request, request_id: str) -> Response:
        start_s = time.monotonic()
        route = self._routes.find(request)
        caller = (
            self._config.gateway.anonymous
            if route.public
            else self._gateway.authenticate(request.headers.get("authorization"))
        )
        return await route.handler(request, Call(request_id, start_s, caller))

    async def _complete(self, request: Request, call: Call, endpoint: type[Endpoint]) -> Response:
        admission = Admission(call)
        with self._telemetry.refusals(admission):
            limits = self._config.limits
            document = await read_json_object(request, limits.max_body_bytes, limits.max_json_depth)
            tier = request.headers.get("x-sla-tier")
            accepted = await self._accept(admission, document, endpoint, tier)
        events = self._answers.stream(accepted)
        headers = accepted.response_headers(self._config.pool(accepted.pool).model_name)
        query = self._cache.query(accepted.body, accepted.tier, request.headers)
        if query is not None:  # the lookup races the generation's first step
            accepted.cache = Lookup(query, accepted.tier)
            events = await self._cache.race(accepted.cache, call.request_id, events)
            headers.update(accepted.cache.headers)
            if accepted.cache.hit:
                return self._answers.replay(accepted, headers)
        if not accepted.body.stream:
            return JSONResponse(await self._answers.collect(accepted, events), headers=headers)
        # Wait for the first delta so an engine-side rejection is still a 400, not a broken stream.
        first = await anext(events)
        stream = sse_stream(accepted, prepend(first, events))
        return StreamingResponse(stream, media_type="text/event-stream", headers=headers)

    async def run_batch_line(
        self, url: str, document: dict[str, Any]
    ) -> tuple[int, dict[str, Any]]:
        """One line of a batch accepted (the batch runner calls this), at the batch jobs' tier:
        the same checks and placement as over HTTP (not the key's rate limits: the runner
        paces its lines); answered as (status, JSON body)."""
        call = Call(uuid.uuid4().hex, time.monotonic(), BATCH_RUNNER)
        admission = Admission(call)
        try:
            document = {**document, "stream": False}
            with self._telemetry.refusals(admission):
                tier = self._config.batch_jobs.tier
                accepted = await self._accept(admission, document, ENDPOINTS[url], tier)
            return 200, await self._answers.collect(accepted, self._answers.stream(accepted))
        except ApiError as error:
            refusal = error
        except Exception:
            log.exception("batch line %s failed", call.request_id)
            refusal = internal_error(call.request_id)
        return refusal.status, refusal.body()

    async def _accept(
        self,
        admission: Admission,
        document: dict[str, Any],
        endpoint: type[Endpoint],
        tier_name: str | None,
    ) -> AcceptedRequest:
        """The request's accepted, charged to its caller and counted as admitted; the 4xx or 503
        that refuses it otherwise (`admission` keeps what was learned, for its log line)."""
        admission.user = _end_user(document)
        body = parse_body(endpoint.schema, document)
        if body.model not in self._planner.model_names:
            names = self._planner.model_names
            message = f"The model {body.model!r} does not exist; use one of {names}."
            raise ApiError(404, message, code="model_not_found", param="model")
        check_limits(body, self._config.limits)
        tier = self._planner.tier(tier_name, body, admission.call.caller)
        admission.tier = tier.name
        prompts = await asyncio.to_thread(endpoint.prompt_ids, body, self._tokenizer)
        accepted = self._planner.plan(admission, body, tier, prompts, endpoint)
        self._gateway.charge(accepted.key, len(accepted.choices), accepted.num_reserved_tokens)
        self._telemetry.count_admitted(tier.name, accepted.placement)
        return accepted


async def _default_model_tokenizer(
    config: IngressConfig, pools: dict[str, DeploymentHandle]
) -> Any:
    """Pools of one family share a tokenizer; routing needs the token count first. The
    default model's pools have it from the start (a small pool may still be loading)."""
    return await first_answer(
        [
            cast(DeploymentResponse, handle.tokenizer.remote())
            for name, handle in pools.items()
            if config.pool(name).model_name == config.model_name
        ]
    )


def _end_user(document: dict[str, Any]) -> str | None:
    """The body's `user` (OpenAI's id of the caller's end user) when it is a string."""
    user = document.get("user")
    return user[:MAX_USER_CHARS] if isinstance(user, str) else None
