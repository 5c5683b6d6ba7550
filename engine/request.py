"""Per-request state: tokens, the computed prefix, blocks, drafts, status.

There is no prefill or decode phase: a request has `token_ids` (prompt plus
output so far) and `num_computed_tokens`, the prefix whose K/V sits in the
cache. Each step the scheduler lets it catch up by some tokens; when it has
caught up the sampler appends one. Speculative tokens ride behind as
`spec_token_ids`, computed with the rest and dropped again on rejection.

One owner writes each field after admission: the scheduler (status, computed
tokens, drafts, output tokens, finishing, timestamps) and the KV manager
(block ids and hashes). Everyone else reads.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from engine.sampling_params import PoolingParams, SamplingParams


class RequestStatus(enum.Enum):
    """Where a request is: queued, in the running batch, or done for good."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Urgency(NamedTuple):
    """How soon a request must be served: its priority and its time-per-token target."""

    priority: int = 0
    """Lower runs first (vLLM's convention)."""
    tpot_target_s: float | None = None
    """Seconds per output token it was promised (None: no target); see Request.tpot_target_s."""


DEFAULT_URGENCY = Urgency()
"""Priority 0, no time-per-token target."""
MIN_BUDGET_SHARE = 0.5
"""A request behind its target asks its next steps for no less than this share of it: its
own decodes (and the due ones beside it) still run, only what rides along gives way."""


@dataclass(eq=False)
class Request:
    """One sequence being generated; identity-hashed so it can key a step's dicts."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    """Lower runs first (vLLM's convention)."""
    tpot_target_s: float | None = None
    """The time per output token this request was promised: while it runs, less urgent
    work joins a step only as far as the step still fits in it (engine/scheduler.py)."""
    eos_token_ids: frozenset[int] = frozenset()
    """The model's end-of-sequence ids: they stop the request unless it ignores EOS."""
    sampling_seed: int = 0
    """Keys every random draw of this request with the output position (engine/sampler.py):
    `params.seed` when given, else one the engine drew."""
    pooling: PoolingParams | None = None
    """Set for an embedding request (engine/pooling.py): it prefills its prompt, whole and
    never from the prefix cache, and ends with the pooled hidden state, sampling nothing."""
    arrival: int = 0
    """Arrival order in its scheduler (set by `Scheduler.add`): breaks priority ties."""
    arrival_time_s: float = field(default_factory=time.monotonic)
    first_scheduled_time_s: float | None = None
    """When the request first entered the running batch: its queue time ends there."""
    first_token_time_s: float | None = None
    """When its first output token was appended: its time per token is measured from here."""
    last_token_time_s: float | None = None
    """When its newest output token was appended: a decode with a looser target than the
    step's tightest may wait until it is due (engine/scheduler.py)."""
    token_ids: list[int] = field(init=False)
    """Prompt then output tokens, appended to in place."""
    spec_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens the prefix cache supplied at first admission."""
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    """Hash chain of this request's full blocks, extended as tokens arrive."""
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    def append_output_token(self, token_id: int) -> None:
        """Add one sampled token (the scheduler's update is the only caller)."""
        self.token_ids.append(token_id)
        self.last_token_time_s = time.monotonic()
        if self.first_token_time_s is None:
            self.first_token_time_s = self.last_token_time_s

    def step_budget_s(self, now_s: float) -> float | None:
        """What the next step may take with this request's mean time per token since its
        first token kept within its target: the target, less what its tokens so far took
        beyond theirs (never below MIN_BUDGET_SHARE of it; a client measures the mean, and
        steps kept each within the target still came out 5-15% over it on a core shared
        with another pool). None without a target."""
        target_s = self.tpot_target_s
        if target_s is None or self.first_token_time_s is None:
            return target_s
        left_s = target_s * self.num_output_tokens - (now_s - self.first_token_time_s)
        return min(target_s, max(MIN_BUDGET_SHARE * target_s, left_s))

    @property
    def queue_time_s(self) -> float | None:
        """Seconds from arrival to first scheduling; None while still waiting."""
        if self.first_scheduled_time_s is None:
            return None
        return self.first_scheduled_time_s - self.arrival_time_s

    @property
    def output_token_ids(self) -> list[int]:
        """The tokens generated so far."""
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        """Tokens including the drafts riding as lookahead."""
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """How many tokens were generated so far."""
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def is_prefilling(self) -> bool:
        """More than the newest token left to compute: a prompt (or recomputation) in progress."""
        return self.num_tokens - self.num_computed_tokens > 1

    @property
    def sort_key(self) -> tuple[int, int]:
        """Scheduling order: priority first, then arrival."""
        return (self.priority, self.arrival)

    @property
    def is_finished(self) -> bool:
        """Finished for good (stop, length, abort or error)."""
        return self.status == RequestStatus.FINISHED
