"""An accepted request: what the ingress decided for one HTTP call it will serve.

Made by the planner (serving/http/planner.py), read by the ingress as it streams
the pool's tokens back; what its response headers and its log line say of it is here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from engine.sampling_params import SEED_MAX, SEED_MIN, SamplingParams
from policies.model_routing import ModelChoice
from policies.placement import Placement
from policies.tiers import Tier
from serving.cache.semantic_cache import Lookup
from serving.gateway_config import CallerPolicy
from serving.http.openai_api import Endpoint
from serving.http.schemas.responses import Usage
from serving.http.schemas.sampling import SamplingFields
from serving.http.streaming import SequenceProgress
from serving.pools.pool import NewSequence
from serving.telemetry import RequestRecord


@dataclass
class AcceptedRequest:
    """An accepted request: where it runs, what it samples, and each choice's progress."""

    request_id: str
    key: CallerPolicy
    tier: Tier
    pool: str
    endpoint: Endpoint
    body: SamplingFields
    prompts: list[list[int]]
    params: SamplingParams
    choices: list[SequenceProgress]
    time_limit_s: float
    """The tier's deadline (or the app's request timeout), from arrival."""
    deadline_s: float
    """Monotonic time past which the request is aborted."""
    placement: Placement
    """Why this pool: the predicted latency and whether the request was downgraded."""
    model_choice: ModelChoice
    """Which model the request asked for or the router chose, and why."""
    user: str | None
    """The body's `user` (OpenAI's end-user id), for the request log."""
    cache: Lookup | None = None
    """What the semantic cache found, when it applies to the request (serving/cache/)."""

    @property
    def tpot_target_s(self) -> float | None:
        """The time per token the pool must keep for this request: its tier's target,
        none once downgraded."""
        return None if self.placement.downgraded else self.tier.tpot_target_s

    @property
    def num_reserved_tokens(self) -> int:
        """What the request may cost at most: every choice's prompt plus max_tokens."""
        prompt = sum(len(self.prompts[c.prompt_index]) for c in self.choices)
        return prompt + self.params.max_tokens * len(self.choices)

    def new_sequences(self) -> list[NewSequence]:
        """One engine request per choice; `n` copies of a seeded prompt get distinct seeds."""
        requests = []
        for index, choice in enumerate(self.choices):
            seed = None if self.params.seed is None else _nth_seed(self.params.seed, index)
            requests.append(
                NewSequence(
                    request_id=f"{self.request_id}-{index}",
                    prompt_token_ids=self.prompts[choice.prompt_index],
                    params=replace(self.params, seed=seed),
                    priority=self.tier.priority,
                    tpot_target_s=self.tpot_target_s,
                    stream=self.body.stream,
                )
            )
        return requests

    def response_headers(self, model_name: str) -> dict[str, str]:
        """Every response names where it went (`model_name`: the pool's model) and, when
        placement predicted it, the latency it was placed for."""
        headers = {
            "x-tierserve-tier": self.tier.name,
            "x-tierserve-pool": self.pool,
            "x-tierserve-model": model_name,
        }
        prediction = self.placement.prediction
        if prediction is not None:
            headers["x-tierserve-predicted-ttft-ms"] = f"{prediction.ttft_s * 1000:.0f}"
            headers["x-tierserve-predicted-tpot-ms"] = f"{prediction.tpot_s * 1000:.1f}"
        if self.placement.downgraded:
            headers["x-tierserve-downgraded"] = "true"
        if self.model_choice.difficulty is not None:
            headers["x-tierserve-difficulty"] = f"{self.model_choice.difficulty:.3f}"
        return headers

    def log_record(
        self, status: str, tokenizer: Any, log_prompts: bool, replayed: Usage | None = None
    ) -> RequestRecord:
        """The request's log line and metrics, as it ends with `status`; its words only
        with `log_prompts` (the first prompt decoded by `tokenizer`); `replayed`: a cache
        hit's usage."""
        return RequestRecord(
            request_id=self.request_id,
            key_name=self.key.name,
            tier=self.tier,
            pool=self.pool,
            status=status,
            choices=self.choices,
            end_s=time.monotonic(),
            prompt_text=tokenizer.decode(self.prompts[0]) if log_prompts else None,
            request_text=self.body.routing_text if log_prompts else None,
            max_tokens=self.body.requested_max_tokens,
            user=self.user,
            placement=self.placement,
            replayed=replayed,
        )


def _nth_seed(seed: int, index: int) -> int:
    """`seed + index`, wrapped to stay a 64-bit seed (a seed near the top with n > 1)."""
    return SEED_MIN + (seed + index - SEED_MIN) % (SEED_MAX - SEED_MIN + 1)
