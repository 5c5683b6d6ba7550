"""Where an admitted request runs and with what: its tier, model, pool, sampling and deadline.

The ingress hands a parsed, tokenized request here; the answer is an AcceptedRequest,
or the OpenAI error that refuses it (a 400 for a bad tier or context, a 429 when no
pool serves it in time, a 503 when none is live). The decisions themselves are the
pure policies' (policies/placement.py, policies/model_routing.py); this is their glue
to the pools' live state.
"""

from __future__ import annotations

import math
import random
import time
from typing import Protocol

from policies.difficulty import prompt_features
from policies.model_routing import ModelChoice, ModelRoutes, choose_model
from policies.placement import RequestShape, ShedFirst, place
from policies.tiers import Tier, resolve_tier
from serving.config import IngressConfig
from serving.gateway_config import CallerPolicy
from serving.http.accepted import AcceptedRequest
from serving.http.engine_inputs import sampling_params
from serving.http.errors import (
    bad_request,
    context_length_exceeded,
    model_unavailable,
    pool_unavailable,
    too_many_requests,
)
from serving.http.gateway import Gateway
from serving.http.openai_api import ChatEndpoint, Endpoint
from serving.http.schemas.sampling import SamplingFields
from serving.http.streaming import SequenceProgress
from serving.http.student_router import StudentRouter
from serving.pools.pool_monitor import PoolMonitor
from serving.telemetry import Admission, Telemetry


class TierField(Protocol):
    """A body that may name its tier (completions and embeddings)."""

    tier: str | None


class Planner:
    """Tier, model and pool choice for the ingress, over the pools' live load."""

    def __init__(
        self,
        config: IngressConfig,
        router: StudentRouter | None,
        gateway: Gateway,
        monitor: PoolMonitor,
        telemetry: Telemetry,
        tokenizer: object,
    ) -> None:
        self._config = config
        self._router = router
        self._models = model_routes(config)
        self._gateway = gateway
        self._monitor = monitor
        self._telemetry = telemetry
        self._tokenizer = tokenizer
        self._shed_first = ShedFirst()

    @property
    def model_names(self) -> tuple[str, ...]:
        """The models requests may name."""
        return self._models.names

    def _place(
        self,
        admission: Admission,
        body: SamplingFields,
        tier: Tier,
        prompts: list[list[int]],
    ) -> tuple[ModelChoice, str]:
        """The model and pool for a request (its placement kept in `admission`), or the
        429 or 503 that refuses it."""
        if not all(prompts):
            raise bad_request("prompt must not be empty", param="prompt")
        longest = max(len(p) for p in prompts)
        shape = RequestShape(
            longest,
            body.requested_max_tokens or 0,
            len(prompts) * body.n,
            constrained=bool(body.grammar_params()),
        )
        choice = self._choose_model(body, tier, longest)
        now_s = time.monotonic()
        placement = self._shed_first.refusal(choice.tier, now_s) or place(
            choice.tier, shape, self._monitor.states(), jitter=random.random()
        )
        self._shed_first.note(choice.tier, placement, now_s)
        admission.placement = placement
        if placement.reason == "unavailable" and choice.model == self._models.small_model:
            why = self._monitor.unavailable_reason(choice.tier.pool)
            raise model_unavailable(choice.model, why, placement.retry_after_s or 1)
        if placement.reason == "unavailable":
            raise pool_unavailable(tier.name, placement.retry_after_s or 1)
        if placement.pool is None:
            raise too_many_requests(
                f"Tier {tier.name!r} is over capacity ({placement.reason}).",
                placement.retry_after_s or 1,
                reason=placement.reason,
            )
        return choice, placement.pool

    def plan(
        self,
        admission: Admission,
        body: SamplingFields,
        tier: Tier,
        prompts: list[list[int]],
        endpoint_cls: type[Endpoint],
    ) -> AcceptedRequest:
        """Pool, sampling and deadline for a request, or the 4xx that refuses it."""
        choice, pool = self._place(admission, body, tier, prompts)
        call, placement = admission.call, admission.placement
        assert placement is not None  # place placed it
        longest = max(len(p) for p in prompts)
        max_tokens = self._max_tokens(body.requested_max_tokens, longest, pool)
        prefix = "chatcmpl" if endpoint_cls is ChatEndpoint else "cmpl"
        request_id = f"{prefix}-{call.request_id}"
        model_name = self._config.pool(pool).model_name
        endpoint = endpoint_cls.for_request(
            body, prompts, request_id, int(time.time()), model_name, self._tokenizer
        )
        time_limit_s = min(tier.deadline_s or math.inf, self._config.request_timeout_s)
        return AcceptedRequest(
            request_id=request_id,
            key=call.caller,
            tier=tier,
            pool=pool,
            endpoint=endpoint,
            body=body,
            prompts=prompts,
            params=sampling_params(body, max_tokens),
            choices=_sequences(call.start_s, len(prompts), body.n),
            time_limit_s=time_limit_s,
            deadline_s=call.start_s + time_limit_s,
            placement=placement,
            model_choice=choice,
            user=admission.user,
        )

    def _choose_model(self, body: SamplingFields, tier: Tier, num_tokens: int) -> ModelChoice:
        """The model for this request (policies/model_routing.py); counted in the metrics."""
        small_pool = self._models.small_pool
        available = small_pool is not None and bool(self._monitor.replica_stats(small_pool))
        router = None if self._router is None else self._router.choice().router

        def score() -> tuple[float, bool]:
            """The router's verdict, computed only when the choice needs it."""
            assert router is not None  # passed only with a router
            features = prompt_features(body.routing_text, num_tokens, body.requested_max_tokens)
            return router.score(features), router.routes_to_small(features)

        scorer = None if router is None else score
        choice = choose_model(body.model, tier, self._models, available, scorer)
        self._telemetry.count_model_decision(tier.name, choice.model, choice.reason)
        return choice

    def tier(self, header: str | None, body: TierField, caller: CallerPolicy) -> Tier:
        """The tier asked for (header, body, key default), if it exists and the key may use it."""
        names = [t.name for t in self._config.tiers]
        try:
            name = resolve_tier(
                header, body.tier, caller.default_tier, self._config.default_tier, names
            )
        except ValueError as error:
            raise bad_request(str(error), param="tier") from None
        self._gateway.authorize_tier(caller, name)
        return self._config.tier(name)

    def _max_tokens(self, requested: int | None, num_prompt_tokens: int, pool: str) -> int:
        """The request's max_tokens, by default the rest of the context, as vLLM does."""
        max_model_len = self._monitor.max_model_len(pool)
        max_tokens = (
            requested if requested is not None else max(1, max_model_len - num_prompt_tokens)
        )
        if num_prompt_tokens + max_tokens > max_model_len:
            raise context_length_exceeded(num_prompt_tokens, max_tokens, max_model_len)
        return max_tokens


def model_routes(config: IngressConfig) -> ModelRoutes:
    """The models the config serves: the default one and the small pool's, if any."""
    small = config.small_model
    if small is None:
        return ModelRoutes(config.model_name)
    return ModelRoutes(config.model_name, config.pool(small.pool).model_name, small.pool)


def _sequences(start_s: float, num_prompts: int, n: int) -> list[SequenceProgress]:
    """`n` sequences per prompt, in OpenAI's choice order."""
    indices = [i for i in range(num_prompts) for _ in range(n)]
    return [SequenceProgress(start_s=start_s, prompt_index=i) for i in indices]
