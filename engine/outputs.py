"""What comes out of a step: the runner's tokens for the scheduler, and what the engine hands
back (one RequestOutput per request per step, and live stats)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple

from engine.request import Request
from engine.step_cost import StepCostFit


class TokenLogprob(NamedTuple):
    """A chosen token's log-probability under the raw model, and the likeliest tokens'."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    """(token id, log-probability) of the `params.logprobs` likeliest, most likely first."""


@dataclass(frozen=True)
class RunnerOutput:
    """What a step produced, per request that caught up with its tokens."""

    sampled_token_ids: dict[Request, list[int]] = field(default_factory=dict)
    """Accepted drafts then one sampled token; the scheduler cuts at a stop."""
    logprobs: dict[Request, list[TokenLogprob]] = field(default_factory=dict)
    """Of each sampled token, only for requests that asked."""
    prompt_logprobs: dict[Request, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)
    """For requests that asked: the index of the first prompt token this step scored, and
    the scores of it and the following ones (each under the tokens before it)."""
    embeddings: dict[Request, list[float]] = field(default_factory=dict)
    """Embedding requests whose whole prompt is now computed: the pooled vector of each."""
    failed: dict[Request, str] = field(default_factory=dict)
    """Requests whose own sampling raised, with the error: they end, the batch goes on."""


class FirstTokenTimes(NamedTuple):
    """Wall-clock instants (time.time(): one clock for every process on a host, and close
    across hosts) on a request's way to its first token, so a TTFT that no queue explains
    can be placed hop by hop. The engine fills the middle three; its async front, in the
    pool replica, the first and the last."""

    sent_s: float | None
    """The front handed the request to its loop (None until the front fills it in)."""
    arrived_s: float
    """The loop took it from its inbox: it waits there while a step runs."""
    scheduled_s: float
    """The scheduler first put it in a step."""
    first_token_s: float
    """The step that sampled its first token ended."""
    received_s: float | None = None
    """The front got that output back from its loop."""


@dataclass(frozen=True)
class RequestOutput:
    """The tokens and text a request gained in one step (a delta, not the whole)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    """`stop`, `length`, `abort` or `error` once finished."""
    error: str | None = None
    """What went wrong, when finish_reason is `error` (the request alone failed)."""
    new_logprobs: list[TokenLogprob] | None = None
    """One per new token, when the request asked for logprobs."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """One per prompt token (None for the first, which nothing predicts), in the request's
    first output, when it asked for them."""
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    queue_time_s: float | None = None
    """Time from arrival until the request was first scheduled."""
    first_token_times: FirstTokenTimes | None = None
    """On the output carrying the request's first token."""
    embedding: list[float] | None = None
    """An embedding request's pooled vector, in its one (finished) output."""

    def then(self, later: RequestOutput) -> RequestOutput:
        """This delta and the request's next one as a single delta (tokens, text and
        logprobs joined; the ending and counters of the later one)."""
        logprobs = None
        if self.new_logprobs is not None or later.new_logprobs is not None:
            logprobs = (self.new_logprobs or []) + (later.new_logprobs or [])
        return replace(
            later,
            new_token_ids=self.new_token_ids + later.new_token_ids,
            new_text=self.new_text + later.new_text,
            new_logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs,
            num_prompt_tokens=later.num_prompt_tokens or self.num_prompt_tokens,
            queue_time_s=self.queue_time_s if self.queue_time_s is not None else later.queue_time_s,
            first_token_times=self.first_token_times or later.first_token_times,
        )


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for routing, autoscaling and metrics."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    """Fraction of KV blocks in use by live requests (0..1)."""
    prefix_cache_queries: int
    """Prompt tokens looked up in the prefix cache so far."""
    prefix_cache_hits: int
    """Of those, tokens found cached."""
    num_preemptions: int
    """Requests preempted (KV blocks reclaimed, recomputed later) so far."""
    generation_tokens_per_s: float
    """Output tokens per second over a recent window."""
    prompt_tokens_computed_per_s: float = 0.0
    """Prompt tokens computed (prefix-cache hits not counted) per second over a recent
    window, idle time included: what new prompts add to the steps decodes run in."""
    num_prompt_tokens: int = 0
    """Prompt tokens admitted so far (a counter, for metrics)."""
    num_generation_tokens: int = 0
    """Output tokens produced so far."""
    max_num_seqs: int = 0
    """The batch cap this engine runs with (per replica)."""
    max_num_batched_tokens: int = 0
    """The per-step token budget."""
    num_kv_blocks: int = 0
    """Blocks in the KV pool: EngineConfig.num_kv_blocks, or what kv_cache_memory_gb holds
    in kv_cache_dtype (a quantized cache holds more)."""
    kv_max_num_seqs: int = 0
    """Sequences of max_model_len tokens the KV pool holds at once: the batch the KV admits
    when every request may grow to the context limit (max_num_seqs caps it either way)."""
    kv_cache_dtype: str = "auto"
    """How K/V are stored (EngineConfig.kv_cache_dtype)."""
    seeded_reproducible: bool = False
    """The logits are batch-invariant (engine/model/batch_invariance.py), so a seeded request
    gives the same text whatever shares its steps. Not where `batch_invariant` is off, where
    no row count agrees for some layer, or where the paged kernel does not run (a GPU)."""
    step_cost: StepCostFit = StepCostFit()
    """Fitted step cost (engine/step_cost.py): a step takes base + per sequence in the
    batch + per token computed (a prefill chunk counts its length), in seconds."""
    spec_num_drafts: int = 0
    """Speculative steps that proposed at least one draft token."""
    spec_num_draft_tokens: int = 0
    """Draft tokens proposed; with the next counter, the acceptance rate."""
    spec_num_accepted_tokens: int = 0
    """Draft tokens the target model accepted."""
    spec_num_decode_rows: int = 0
    """Sequences that decoded, summed over steps, drafting or not: per decode, the draft
    tokens computed and the tokens gained (`spec_tokens_per_decode`)."""
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    """Accepted drafts at each draft position: where acceptance falls off."""

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Share of looked-up prompt tokens found in the prefix cache."""
        if not self.prefix_cache_queries:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries

    @property
    def spec_acceptance_rate(self) -> float:
        """Share of proposed draft tokens the target accepted."""
        if not self.spec_num_draft_tokens:
            return 0.0
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens

    @property
    def spec_tokens_per_decode(self) -> tuple[float, float]:
        """Per sequence and decode step, on average: the tokens it computes (1 plus its
        drafts) and the tokens it gains (1 plus those accepted); (1, 1) without drafts."""
        rows = self.spec_num_decode_rows
        if not rows:
            return 1.0, 1.0
        return 1 + self.spec_num_draft_tokens / rows, 1 + self.spec_num_accepted_tokens / rows

    @property
    def spec_mean_accepted_len(self) -> float:
        """Tokens emitted per speculating step: accepted drafts plus the bonus/correction."""
        if not self.spec_num_drafts:
            return 0.0
        return 1 + self.spec_num_accepted_tokens / self.spec_num_drafts
