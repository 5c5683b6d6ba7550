"""What a latency prediction reads of a pool: its step cost, the sequences in flight, its
limits. The ingress builds one from each replica's stats (serving/pools/pool_monitor.py);
policies/latency.py predicts from it."""

from __future__ import annotations

from dataclasses import dataclass, replace

MAX_PROMPT_TIME_SHARE = 0.8
"""A decode step is predicted at most 5 times as long for the prompts arriving beside it
(`PoolState.prompt_time_share`): the measured rate lags a change of load by its window."""


@dataclass(frozen=True)
class StepCost:
    """Seconds a step costs: base, plus per sequence, plus per token computed; plus, for
    each row held to a grammar, its mask."""

    base_s: float
    per_seq_s: float
    per_token_s: float
    """A decode's token (drafts included), at the contexts decodes read."""
    per_constrained_row_s: float = 0.0
    """Filling and applying one row's grammar mask (engine/grammar.py `mask_cost_s`)."""
    per_prompt_token_s: float | None = None
    """A prompt chunk's token, which reads only the prompt so far (None: `per_token_s`)."""

    def step_s(self, num_seqs: int, num_tokens: float, num_prompt_tokens: float = 0) -> float:
        """Predicted duration of a step over `num_seqs` sequences computing `num_tokens`
        decode tokens and `num_prompt_tokens` prompt tokens."""
        decodes_s = self.per_seq_s * num_seqs + self.per_token_s * num_tokens
        return self.base_s + decodes_s + self.prompt_s(num_prompt_tokens)

    def prompt_s(self, num_prompt_tokens: float) -> float:
        """What `num_prompt_tokens` prompt tokens add to a step."""
        per_prompt_token_s = self.per_prompt_token_s
        if per_prompt_token_s is None:
            per_prompt_token_s = self.per_token_s
        return per_prompt_token_s * num_prompt_tokens


@dataclass(frozen=True)
class InFlightSequence:
    """One sequence a pool is working on, as the ingress that sent it knows it."""

    priority: int
    num_prompt_tokens: int
    num_remaining_tokens: int
    """Output tokens it is still expected to produce."""
    prefilled: bool
    """Its first token has arrived: only decoding is left."""
    tpot_target_s: float | None = None
    """The time per token the engine keeps it within (None: no target)."""


@dataclass(frozen=True)
class PoolState:
    """Everything the prediction reads about a pool at one instant."""

    name: str
    num_replicas: int
    max_num_seqs: int
    """Per replica."""
    max_num_batched_tokens: int
    """Per replica and step."""
    cost: StepCost
    in_flight: tuple[InFlightSequence, ...] = ()
    max_queued: int = 0
    """Sequences allowed to wait beyond the batch slots, counted per priority level:
    a request is refused when more than this many of equal or more urgent priority
    would wait ahead of it."""
    cost_per_1k_tokens: float = 0.0
    """What the pool's output costs: the cheaper of two pools that meet an SLO wins."""
    max_request_tokens: int | None = None
    """Prompt + max_tokens above which the pool takes no request (None: no limit)."""
    prefill_step_limit_s: float | None = None
    """The engine's limit on a step's prefill (its first chunk may still take as long as
    the step's decodes; engine/step_targets.py). None: only the token budget."""
    tokens_computed_per_decode: float = 1.0
    """Tokens a decoding sequence computes in a step: 1, plus its drafts on a pool that
    speculates (EngineStats.spec_tokens_per_decode)."""
    tokens_gained_per_decode: float = 1.0
    """Tokens a decoding sequence gains in a step: 1, plus its accepted drafts."""
    prompt_share_computed: float = 1.0
    """Of a prompt's tokens, the share a replica computes; its prefix cache holds the rest
    (1 - EngineStats.prefix_cache_hit_rate). Counted whole, bench_sla's chat prompts, a
    quarter of them a shared template, were predicted a third more prefill steps than
    they took."""

    prompt_tokens_per_s: float = 0.0
    """Per replica: the prompt tokens it computed per second of late, idle time included
    (EngineStats.prompt_tokens_computed_per_s). New prompts keep arriving while a request
    decodes, and their chunks share its steps."""

    @property
    def prompt_time_share(self) -> float:
        """The share of a replica's time its arriving prompts take, at the fitted cost of a
        prompt token; at most MAX_PROMPT_TIME_SHARE."""
        return min(MAX_PROMPT_TIME_SHARE, self.cost.prompt_s(self.prompt_tokens_per_s))

    def idle(self) -> PoolState:
        """This pool with nothing in flight and no prompts arriving: what its engine does for
        a request alone (SLO feasibility, and placement's limits for what the hardware can
        do)."""
        return replace(self, in_flight=(), prompt_tokens_per_s=0.0)

    def prompt_tokens_computed(self, num_prompt_tokens: float) -> float:
        """Of `num_prompt_tokens` prompt tokens, those a replica is expected to compute."""
        return num_prompt_tokens * self.prompt_share_computed

    def decode_tokens(self, num_seqs: int) -> float:
        """Tokens `num_seqs` decoding sequences compute in one step, drafts included."""
        return num_seqs * self.tokens_computed_per_decode

    def decode_step_s(self, num_seqs: int) -> float:
        """One step of `num_seqs` sequences that only decode."""
        return self.cost.step_s(num_seqs, self.decode_tokens(num_seqs))

    @property
    def num_slots(self) -> int:
        """Sequences the pool runs at once, over all replicas."""
        return self.max_num_seqs * max(1, self.num_replicas)
