"""Draft proposers for speculative decoding, and the back-off that keeps them honest.

A proposer guesses up to k next tokens per decoding request; the target then
scores all of them in one forward pass (see `sampler.verify`). Two proposers:

- `NgramProposer` (prompt lookup): find the latest earlier occurrence of the
  request's last n tokens and copy what followed. Free to run, and very good
  on input-grounded tasks (summaries, rewrites, extraction). Its draft is
  deterministic: a one-hot distribution.
- `DraftModelProposer`: a smaller model with the same tokenizer, with its own
  paged KV cache that follows the target's accepted tokens.

`Backoff` shrinks a request's k when drafts keep failing and lets it grow back
when they land, so a bad proposer costs at most the occasional probe.

The speculator only proposes and keeps score: the scheduler places drafts
in the budget as lookahead, the runner verifies them, and the scheduler rolls
back what was rejected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.config import SpecDecodeConfig
from engine.kv_cache import KVCacheManager
from engine.outputs import RunnerOutput
from engine.request import Request
from engine.sampler import draw, probs_for


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


@dataclass
class _BackoffState:
    k: int
    cooldown: int = 0


class Backoff:
    """Per-request draft length: grows by one after a fully accepted draft, halves after
    a fully rejected one, and after dropping to zero waits `cooldown_steps` before
    probing again with a single token. A proposer that is free to run (prompt lookup)
    probes sooner than one that costs forward passes (a draft model)."""

    def __init__(self, max_k: int, cooldown_steps: int) -> None:
        self.max_k = max_k
        self.cooldown_steps = cooldown_steps
        self._state: dict[str, _BackoffState] = {}

    def k_for(self, request_id: str) -> int:
        """The draft length to propose now (0 while cooling down)."""
        state = self._state.setdefault(request_id, _BackoffState(self.max_k))
        if state.k == 0:
            state.cooldown -= 1
            if state.cooldown <= 0:
                state.k = 1
        return state.k

    def record(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """Grow, keep or shrink k after a verification."""
        state = self._state.setdefault(request_id, _BackoffState(self.max_k))
        if num_accepted == num_proposed:
            state.k = min(self.max_k, state.k + 1)
        elif num_accepted == 0:
            state.k //= 2
            if state.k == 0:
                state.cooldown = self.cooldown_steps

    def forget(self, request_id: str) -> None:
        """Drop a finished request's state."""
        self._state.pop(request_id, None)


class Speculator:
    """Glue between a proposer and the back-off, with vLLM's counters.

    Requests with a repetition penalty or an unmet `min_tokens` are not
    speculated: their logits depend on the tokens before each position, which
    `sampler.verify` does not re-apply per draft.
    """

    def __init__(self, proposer: Proposer, max_k: int) -> None:
        self.proposer = proposer
        self.backoff = Backoff(max_k, proposer.cooldown_steps)
        self.max_k = max_k
        self.reset_counters()

    def reset_counters(self) -> None:
        """Zero the drafting counters (after the engine's start-up calibration)."""
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.max_k

    def propose(self, running: list[Request]) -> dict[Request, Proposal]:
        """Drafts for the decoding requests that may speculate this step."""
        wanted = {r: k for r in running if (k := self._draft_len(r)) > 0}
        return self.proposer.propose(wanted) if wanted else {}

    def record(self, drafts: dict[Request, Proposal], result: RunnerOutput) -> None:
        """Count each verified draft (as scheduled) and let the back-off learn from it."""
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
            self.backoff.record(request.request_id, num_proposed, num_accepted)

    def release(self, request: Request) -> None:
        """Forget a finished request."""
        self.proposer.release(request)
        self.backoff.forget(request.request_id)

    def _draft_len(self, request: Request) -> int:
        params = request.params
        decoding = request.num_tokens - request.num_computed_tokens == 1
        if not decoding or params.repetition_penalty != 1.0:
            return 0
        if request.num_output_tokens < params.min_tokens:
            return 0
        room = params.max_tokens - request.num_output_tokens - 1  # the bonus token needs one
        return max(0, min(self.backoff.k_for(request.request_id), room))


def build_speculator(spec: SpecDecodeConfig, draft: DraftModelProposer | None = None) -> Speculator:
    """The pool's speculator: prompt lookup, or the draft proposer the engine built."""
    if spec.method == "ngram":
        return Speculator(
            NgramProposer(spec.ngram_min, spec.ngram_max), spec.num_speculative_tokens
        )
    if draft is None:
        raise ValueError("spec_decode.method 'draft' needs a draft model")
    return Speculator(draft, spec.num_speculative_tokens)
