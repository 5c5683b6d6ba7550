"""Draft proposers for speculative decoding, and the draft length that keeps them paying.

A proposer guesses up to k next tokens per decoding request; the target then
scores all of them in one forward pass (see `sampler.verify`). Two proposers:

- `NgramProposer` (prompt lookup): find the latest earlier occurrence of the
  request's last n tokens and copy what followed. Free to run, and very good
  on input-grounded tasks (summaries, rewrites, extraction). Its draft is
  deterministic: a one-hot distribution.
- `DraftModelProposer`: a smaller model with the same tokenizer, with its own
  paged KV cache that follows the target's accepted tokens.

`DraftLength` picks each request's k from how often its drafts land and what a
draft token costs the step, so a bad proposer costs at most the occasional probe.

The speculator only proposes and keeps score: the scheduler places drafts
in the budget as lookahead, the runner verifies them, and the scheduler rolls
back what was rejected.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.config import SpecDecodeConfig
from engine.kv_cache import KVCacheManager
from engine.outputs import RunnerOutput
from engine.request import Request
from engine.sampler import draw, probs_for
from engine.step_cost import StepCostModel, StepWork

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for one request."""

    token_ids: list[int]


class Proposer(Protocol):
    """Anything that guesses a request's next tokens."""

    cooldown_steps: int
    """Steps a request waits, after its drafts kept failing, before it probes again."""

    def propose(self, requests: dict[Request, int]) -> dict[Request, Proposal]:
        """Up to `k` draft tokens for each request (`requests` maps request -> k)."""
        ...

    def release(self, request: Request) -> None:
        """Forget a finished request."""
        ...


class NgramProposer:
    """Prompt lookup: copy what followed the latest earlier occurrence of the last n tokens."""

    cooldown_steps = 2  # proposing is free; only a failed verify costs (a few % at batch 1)

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def propose(self, requests: dict[Request, int]) -> dict[Request, Proposal]:
        """Up to k drafts per request, copied from earlier in its own tokens."""
        out = {}
        for request, k in requests.items():
            draft = self._lookup(request.token_ids, k)
            if draft:
                out[request] = Proposal(draft)
        return out

    def _lookup(self, tokens: list[int], k: int) -> list[int]:
        """Longest suffix n-gram first; the most recent earlier match wins."""
        for n in range(min(self.ngram_max, len(tokens) - 1), self.ngram_min - 1, -1):
            suffix = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == suffix:
                    return tokens[start + n : start + n + k]
        return []

    def release(self, request: Request) -> None:
        """Nothing to forget: the lookup keeps no state."""


class DraftRunner(Protocol):
    """What the draft proposer needs of a model runner (engine.model.model_runner)."""

    def prepare(self, num_new_tokens: dict[Request, int]) -> Any:
        """Pack the shadows' pending tokens into one batch."""
        ...

    def compute_logits(self, batch: Any) -> torch.Tensor:
        """Logits, one row per request, at each shadow's last position."""
        ...


class DraftModelProposer:
    """Runs a draft model over shadow copies of the requests, in its own KV cache.

    A shadow holds the tokens the draft has seen; before each proposal its
    computed prefix is cut back to what still agrees with the target's real
    tokens, so rejected guesses are recomputed and accepted ones are kept.
    """

    cooldown_steps = 8  # every probe costs k draft forward passes

    def __init__(self, runner: DraftRunner, kv: KVCacheManager) -> None:
        self.runner = runner
        self.kv = kv
        self.shadows: dict[str, Request] = {}

    def propose(self, requests: dict[Request, int]) -> dict[Request, Proposal]:
        """Run the draft k times over every request's shadow, one token per pass."""
        shadows = {r: self._sync_shadow(r) for r in requests}
        active = {r: s for r, s in shadows.items() if self._reserve(s, requests[r])}
        drafts: dict[Request, list[int]] = {r: [] for r in active}
        for _ in range(max((requests[r] for r in active), default=0)):
            todo = {r: s for r, s in active.items() if len(drafts[r]) < requests[r]}
            step = {s: s.num_tokens - s.num_computed_tokens for s in todo.values()}
            logits = self.runner.compute_logits(self.runner.prepare(step))
            for row, (request, shadow) in enumerate(todo.items()):
                shadow.num_computed_tokens = shadow.num_tokens
                token = _draft_token(logits[row], request, len(drafts[request]))
                shadow.append_output_token(token)
                drafts[request].append(token)
        return {r: Proposal(drafts[r]) for r in active}

    def release(self, request: Request) -> None:
        """Free the shadow's blocks in the draft's KV cache."""
        shadow = self.shadows.pop(request.request_id, None)
        if shadow is not None:
            self.kv.free(shadow)

    def _sync_shadow(self, request: Request) -> Request:
        shadow = self.shadows.get(request.request_id)
        if shadow is None:
            shadow = Request(request.request_id, [], request.params)
            self.shadows[request.request_id] = shadow
        agreed = _common_prefix_len(shadow.token_ids, request.token_ids)
        shadow.token_ids = list(request.token_ids)
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, agreed)
        return shadow

    def _reserve(self, shadow: Request, k: int) -> bool:
        """Blocks for the catch-up tokens and k drafts; a request that does not fit sits out."""
        num_tokens = shadow.num_tokens + k
        if not self.kv.can_allocate(shadow, num_tokens, []):
            return False
        self.kv.allocate(shadow, num_tokens, [])
        return True


def _draft_token(logits: torch.Tensor, request: Request, index: int) -> int:
    """The draft's choice for the request's `index`-th lookahead position. It races with
    the noise the target will draw with there (engine/sampler.py), so it is accepted
    whenever the two distributions pick the same token under that noise."""
    if request.params.greedy:
        return int(logits.argmax())
    position = request.num_output_tokens + index
    return draw(probs_for(logits, request.params), request.sampling_seed, position)


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


PRIOR_ACCEPTED = 1.0
PRIOR_REJECTED = 1.0
"""A new request's acceptance counts: alpha starts at 0.5, and its first drafts decide."""
ACCEPTANCE_DECAY = 0.8
"""Weight the past keeps at each verification: about the last five drafts count, so a
request that starts (or stops) copying from its prompt is re-judged within a few steps."""
PROPOSE_S_WEIGHT = 0.1
"""Weight of each new measurement in the running mean of proposing seconds per draft token."""


@dataclass
class _Acceptance:
    accepted: float = PRIOR_ACCEPTED
    rejected: float = PRIOR_REJECTED
    cooldown: int = 0

    @property
    def alpha(self) -> float:
        """Chance that a draft position is accepted, given that the ones before it were."""
        return self.accepted / (self.accepted + self.rejected)


class DraftLength:
    """Per-request draft length: the k that gives most tokens per second of step time.

    A draft is verified left to right up to its first rejection, so each position is
    counted as one trial of a coin that lands "accepted" with chance alpha; alpha is
    counted per request, with decay. k drafts then yield 1 + alpha + ... + alpha^k tokens
    for a step that costs 1 + token_cost * k, where `token_cost` is what one draft token
    adds to the step (verifying it, proposing it) as a share of the step. At batch 1 on a
    CPU the step is memory-bound and a token costs ~1.5% of it, so long drafts pay even
    when they mostly miss; in a big, compute-bound batch the same draft costs a token's
    full share and k drops. The step is shared: a request's drafts slow the token every
    other request of the batch makes in it, so those tokens count on the yield side too
    (`best_draft_len`'s `other_rows`). Judged alone, each of the interactive pool's 12
    streams of bench_sla's chat prompts kept drafting at alpha 0.28, and the batch made
    0.85-0.94x the tokens it made without speculation (0.92-0.96x judged together). When
    no k pays, the request rests `cooldown_steps` steps, then probes with one token: the
    only way alpha can recover.
    """

    def __init__(self, max_k: int, cooldown_steps: int) -> None:
        self.max_k = max_k
        self.cooldown_steps = cooldown_steps
        self._state: dict[str, _Acceptance] = {}

    def k_for(self, request_id: str, token_cost: float, other_rows: int = 0) -> int:
        """The draft length to propose now (0 while resting), in a step where `other_rows`
        other requests make a token each."""
        state = self._state.setdefault(request_id, _Acceptance())
        if state.cooldown > 0:
            state.cooldown -= 1
            return 1 if state.cooldown == 0 else 0
        k = best_draft_len(state.alpha, token_cost, self.max_k, other_rows)
        if k == 0:
            state.cooldown = self.cooldown_steps
        return k

    def record(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """Count a verified draft: its accepted positions, and the rejection that ended it."""
        state = self._state.setdefault(request_id, _Acceptance())
        state.accepted = state.accepted * ACCEPTANCE_DECAY + num_accepted
        state.rejected = state.rejected * ACCEPTANCE_DECAY + (num_accepted < num_proposed)

    def forget(self, request_id: str) -> None:
        """Drop a finished request's state."""
        self._state.pop(request_id, None)


def best_draft_len(alpha: float, token_cost: float, max_k: int, other_rows: int = 0) -> int:
    """argmax over k in 0..max_k of the step's tokens per unit of its time,
    (other_rows + 1 + alpha + ... + alpha^k) / (1 + token_cost * k)."""
    best_k, expected = 0, other_rows + 1.0
    best_rate = expected
    for k in range(1, max_k + 1):
        expected += alpha**k
        rate = expected / (1 + token_cost * k)
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k


class Speculator:
    """Glue between a proposer and the draft length, with vLLM's counters.

    What a draft token costs is learned on the spot: a step-cost fit of its own,
    seconds = base + per sequence + per draft token, over decode-only steps (prefill
    chunks are compute-bound and would price a draft token several times too high at
    small batches; attention is left to the base, as the context drifts slowly), plus
    the proposer's own measured time per draft token.

    Requests with a repetition penalty or an unmet `min_tokens` are not
    speculated: their logits depend on the tokens before each position, which
    `sampler.verify` does not re-apply per draft.
    """

    def __init__(self, proposer: Proposer, max_k: int) -> None:
        self.proposer = proposer
        self.draft_length = DraftLength(max_k, proposer.cooldown_steps)
        self.max_k = max_k
        self.decode_cost = StepCostModel()
        self.propose_s_per_token = 0.0
        self.reset_counters()

    def reset_counters(self) -> None:
        """Zero the drafting counters (after the engine's start-up calibration)."""
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_decode_rows = 0
        """Sequences that decoded, summed over steps, with a draft or without: per decode,
        draft tokens computed and tokens gained (the latency model's view of speculation)."""
        self.accepted_per_pos = [0] * self.max_k

    def propose(self, running: list[Request]) -> dict[Request, Proposal]:
        """Drafts for the decoding requests that may speculate this step; none when the
        proposer fails (speculation is optional)."""
        decoding = [r for r in running if _may_speculate(r)]
        if not decoding:
            return {}
        token_cost = self.token_cost(decoding)
        others = len(running) - 1
        wanted = {r: k for r in decoding if (k := self._draft_len(r, token_cost, others)) > 0}
        if not wanted:
            return {}
        start_s = time.perf_counter()
        try:
            drafts = self.proposer.propose(wanted)
        except Exception:  # noqa: BLE001 - a failing proposer costs the speedup, not requests
            log.exception("draft proposal failed; this step runs without drafts")
            return {}
        self._time_proposer(time.perf_counter() - start_s, sum(wanted.values()))
        return drafts

    def token_cost(self, decoding: list[Request]) -> float:
        """What one more draft token adds to a decode step of `decoding`, as a share of it."""
        step_s = self.decode_cost.step_s(len(decoding), 0, 0)
        token_s = self.decode_cost.token_s(0) + self.propose_s_per_token
        return token_s / step_s if step_s > 0 else 0.0

    def observe_step(
        self,
        num_new_tokens: dict[Request, int],
        drafts: dict[Request, Proposal],
        seconds: float,
    ) -> None:
        """Count the step's decodes; fit the decode-step cost on a step that only decoded
        (drafts included)."""
        decodes = [
            num_new == 1 + (len(drafts[request].token_ids) if request in drafts else 0)
            for request, num_new in num_new_tokens.items()
        ]
        self.num_decode_rows += sum(decodes)
        if not all(decodes):
            return  # a prefill chunk rode along: not a decode step
        num_drafts = sum(num_new_tokens.values()) - len(num_new_tokens)
        self.decode_cost.observe(StepWork(len(num_new_tokens), num_drafts), seconds)

    def record(self, drafts: dict[Request, Proposal], result: RunnerOutput) -> None:
        """Count each verified draft (as scheduled) and let the draft length learn from it."""
        for request, draft in drafts.items():
            if request not in result.sampled_token_ids:
                continue  # the request failed: nothing was verified
            num_proposed = len(draft.token_ids)
            num_accepted = len(result.sampled_token_ids[request]) - 1
            self.num_drafts += 1
            self.num_draft_tokens += num_proposed
            self.num_accepted_tokens += num_accepted
            for pos in range(num_accepted):
                self.accepted_per_pos[pos] += 1
            self.draft_length.record(request.request_id, num_proposed, num_accepted)

    def release(self, request: Request) -> None:
        """Forget a finished request."""
        self.proposer.release(request)
        self.draft_length.forget(request.request_id)

    def _draft_len(self, request: Request, token_cost: float, other_rows: int) -> int:
        room = request.params.max_tokens - request.num_output_tokens - 1  # bonus token's
        k = self.draft_length.k_for(request.request_id, token_cost, other_rows)
        return max(0, min(k, room))

    def _time_proposer(self, seconds: float, num_tokens: int) -> None:
        per_token = seconds / num_tokens
        self.propose_s_per_token += PROPOSE_S_WEIGHT * (per_token - self.propose_s_per_token)


def _may_speculate(request: Request) -> bool:
    """Decoding (one token to compute), with no logits processing that verify cannot redo."""
    params = request.params
    decoding = request.num_tokens - request.num_computed_tokens == 1
    return (
        decoding
        and request.pooling is None  # an embedding request never decodes
        and params.repetition_penalty == 1.0
        and request.num_output_tokens >= params.min_tokens
    )


def build_speculator(spec: SpecDecodeConfig, draft: DraftModelProposer | None = None) -> Speculator:
    """The pool's speculator: prompt lookup, or the draft proposer the engine built."""
    if spec.method == "ngram":
        return Speculator(
            NgramProposer(spec.ngram_min, spec.ngram_max), spec.num_speculative_tokens
        )
    if draft is None:
        raise ValueError("spec_decode.method 'draft' needs a draft model")
    return Speculator(draft, spec.num_speculative_tokens)
