"""An accepted request: what the ingress decided for one HTTP call it will serve.

Made by the planner (serving/http/planner.py), read by the ingress as it streams
the pool's tokens back and writes the request's log line.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.sampling_params import SEED_MAX, SEED_MIN, SamplingParams
from policies.model_routing import ModelChoice
from policies.placement import Placement
from policies.tiers import Tier
from serving.config import CallerPolicy
from serving.http import schemas
from serving.http.openai_api import Endpoint
from serving.http.streaming import SequenceProgress
from serving.pools.pool import NewSequence


@dataclass
class AcceptedRequest:
    """An accepted request: where it runs, what it samples, and each choice's progress."""

    request_id: str
    key: CallerPolicy
    tier: Tier
    pool: str
    endpoint: Endpoint
    body: schemas.SamplingFields
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


def _nth_seed(seed: int, index: int) -> int:
    """`seed + index`, wrapped to stay a 64-bit seed (a seed near the top with n > 1)."""
    return SEED_MIN + (seed + index - SEED_MIN) % (SEED_MAX - SEED_MIN + 1)
