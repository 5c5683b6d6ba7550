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
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch

from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.loader import load_model
from engine.model import LlamaForCausalLM
from engine.model_runner import ModelRunner
from engine.request import Request
from engine.sampler import SampleRow, probs_for, verify


@dataclass(frozen=True)
class Proposal:
    token_ids: list[int]
    probs: torch.Tensor | None = None
    """[len(token_ids), vocab] draft distributions; None for a deterministic (one-hot) draft."""


class Proposer(Protocol):
    cooldown_steps: int
    """Steps a request waits, after its drafts kept failing, before it probes again."""

    def propose(self, requests: dict[Request, int]) -> dict[Request, Proposal]:
        """Up to `k` draft tokens for each request (`requests` maps request -> k)."""
        ...

    def release(self, request: Request) -> None:
        """Forget a finished request."""
        ...


class NgramProposer:
    cooldown_steps = 2  # proposing is free; only a failed verify costs (a few % at batch 1)

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def propose(self, requests: dict[Request, int]) -> dict[Request, Proposal]:
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
        pass


class DraftModelProposer:
    """Runs a draft model over shadow copies of the requests, in its own KV cache.

    A shadow holds the tokens the draft has seen; before each proposal its
    computed prefix is cut back to what still agrees with the target's real
    tokens, so rejected guesses are recomputed and accepted ones are kept.
    """

    cooldown_steps = 8  # every probe costs k draft forward passes

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, device: str):
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(model, num_blocks, block_size, device)
        self.shadows: dict[str, Request] = {}

    def propose(self, requests: dict[Request, int]) -> dict[Request, Proposal]:
        shadows = {r: self._sync_shadow(r) for r in requests}
        active = {r: s for r, s in shadows.items() if self._reserve(s, requests[r])}
        drafts: dict[Request, list[int]] = {r: [] for r in active}
        probs: dict[Request, list[torch.Tensor]] = {r: [] for r in active}
        for _ in range(max((requests[r] for r in active), default=0)):
            todo = {r: s for r, s in active.items() if len(drafts[r]) < requests[r]}
            step = {s: s.num_tokens - s.num_computed_tokens for s in todo.values()}
            logits = self.runner.execute(self.runner.prepare(step))
            for row, (request, shadow) in enumerate(todo.items()):
                shadow.num_computed_tokens = shadow.num_tokens
                token, dist = _draft_token(logits[row], request, shadow)
                shadow.append_output_token(token)
                drafts[request].append(token)
                probs[request].append(dist)
        return {
            r: Proposal(drafts[r], None if r.params.greedy else torch.stack(probs[r]))
            for r in active
        }

    def release(self, request: Request) -> None:
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


def _draft_token(logits: torch.Tensor, request: Request, shadow: Request):
    """The draft's own choice under the request's sampling settings, and its distribution."""
    if request.params.greedy:
        return int(logits.argmax()), None
    dist = probs_for(logits, request.params)
    token = int(torch.multinomial(dist, 1))
    return token, dist


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
        state = self._state.setdefault(request_id, _BackoffState(self.max_k))
        if state.k == 0:
            state.cooldown -= 1
            if state.cooldown <= 0:
                state.k = 1
        return state.k

    def record(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        state = self._state.setdefault(request_id, _BackoffState(self.max_k))
        if num_accepted == num_proposed:
            state.k = min(self.max_k, state.k + 1)
        elif num_accepted == 0:
            state.k //= 2
            if state.k == 0:
                state.cooldown = self.cooldown_steps

    def forget(self, request_id: str) -> None:
        self._state.pop(request_id, None)


class Speculator:
    """Glue between a proposer, the back-off and verification, with vLLM's counters.

    Requests with a repetition penalty or an unmet `min_tokens` are not
    speculated: their logits depend on the tokens before each position, which
    `sampler.verify` does not re-apply per draft.
    """

    def __init__(self, proposer: Proposer, max_k: int) -> None:
        self.proposer = proposer
        self.backoff = Backoff(max_k, proposer.cooldown_steps)
        self._draft_probs: dict[str, torch.Tensor | None] = {}
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * max_k

    def propose(self, running: list[Request]) -> None:
        """Give each decoding request its drafts (`spec_token_ids`) for the coming step."""
        wanted = {r: k for r in running if (k := self._draft_len(r)) > 0}
        for request, proposal in self.proposer.propose(wanted).items():
            request.spec_token_ids = list(proposal.token_ids)
            self._draft_probs[request.request_id] = proposal.probs

    def verify(
        self, request: Request, logits: torch.Tensor, row: SampleRow
    ) -> tuple[list[int], list[float]]:
        """Check the drafts that were scheduled (the scheduler may have cut some)."""
        drafts = request.spec_token_ids
        probs = self._draft_probs.pop(request.request_id, None)
        if probs is not None:
            probs = probs[: len(drafts)]
        token_ids, logprobs = verify(logits, row, drafts, probs)
        num_accepted = len(token_ids) - 1
        self.num_drafts += 1
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1
        self.backoff.record(request.request_id, len(drafts), num_accepted)
        return token_ids, logprobs

    def release(self, request: Request) -> None:
        self.proposer.release(request)
        self.backoff.forget(request.request_id)
        self._draft_probs.pop(request.request_id, None)

    def _draft_len(self, request: Request) -> int:
        params = request.params
        decoding = request.num_tokens - request.num_computed_tokens == 1
        if not decoding or params.repetition_penalty != 1.0:
            return 0
        if request.num_output_tokens < params.min_tokens:
            return 0
        room = params.max_tokens - request.num_output_tokens - 1  # the bonus token needs one
        return max(0, min(self.backoff.k_for(request.request_id), room))


def build_speculator(config: EngineConfig, num_blocks: int) -> Speculator | None:
    """The pool's speculator from its config; None when speculation is off."""
    spec = config.spec_decode
    if spec is None:
        return None
    if spec.method == "ngram":
        proposer: Proposer = NgramProposer(spec.ngram_min, spec.ngram_max)
    else:
        draft_config = replace(config, model=spec.draft_model or config.model, spec_decode=None)
        draft, _ = load_model(draft_config, num_layers=spec.draft_num_layers)
        proposer = DraftModelProposer(draft, num_blocks, config.block_size, config.device)
    return Speculator(proposer, spec.num_speculative_tokens)
