"""Continuous batching in vLLM v1's style: one token budget, no phases.

Every step, each running request is given the tokens it still lacks
(`num_tokens_with_spec - num_computed_tokens`), cut to what is left of the
budget: a long prompt gets a chunk, a decoding request gets 1 (or 1 + k when
it speculates). Waiting requests are admitted in (priority, arrival) order
while the batch and the KV pool have room, starting past their cached prefix.
When blocks run out, or a more urgent request waits on a full batch, the
least urgent running request is preempted: its blocks are freed and it is
recomputed from scratch later (with luck, from the prefix cache).

Requests may carry a time-per-token target (`Request.tpot_target_s`): their
decodes are scheduled first, and the rest of the step is cut to what the
targets and the prefill step limit allow (engine/step_targets.py). This is
what lets an interactive request share a pool with a big batch, and a long
prompt share a step with streams that are decoding.

After the forward pass, `update` is the one place request state advances:
computed tokens, naming full blocks for the prefix cache, appending sampled
tokens up to a stop token or the length limit, rolling back rejected draft
lookahead, and finishing.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.kv_cache import KVCacheManager
from engine.outputs import RunnerOutput
from engine.request import Request, RequestStatus
from engine.step_cost import StepCostModel, StepWork
from engine.step_targets import StepTargets

if TYPE_CHECKING:
    from engine.spec_decode import Proposal


@dataclass
class SchedulerOutput:
    """What one step computes: the runner's whole input, and what `update` settles."""

    num_new_tokens: dict[Request, int] = field(default_factory=dict)
    """The requests that run this step, in batch order, and how many tokens each computes."""
    drafts: dict[Request, Proposal] = field(default_factory=dict)
    """Drafts to verify this step, cut to what fit (`request.spec_token_ids` holds the same)."""
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        """Tokens this step computes across the batch."""
        return sum(self.num_new_tokens.values())

    @property
    def attended_positions(self) -> int:
        """Context positions this step's tokens read, summed (a chunk's tokens each counted
        at the chunk's end: the work of attention, up to a chunk's causal half)."""
        return sum(_attended(r, n) for r, n in self.num_new_tokens.items())

    @property
    def work(self) -> StepWork:
        """The step as the step-cost fit reads it, its prompt chunks' positions counted as
        `attended_positions` counts them (read before the update advances the requests)."""
        chunks = [(r, n) for r, n in self.num_new_tokens.items() if r.is_prefilling]
        return StepWork(
            len(self.num_new_tokens), self.total_tokens, self.attended_positions,
            sum(n for _, n in chunks), sum(_attended(r, n) for r, n in chunks),
        )  # fmt: skip


def _attended(request: Request, num_new: int) -> int:
    """Positions `num_new` tokens of `request` read, each counted at the chunk's end."""
    return num_new * (request.num_computed_tokens + num_new)


class Scheduler:
    """Decides who computes what each step, and advances request state after it.

    Owns the waiting queue and the running batch; never touches a tensor.
    """

    def __init__(
        self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
        step_cost: StepCostModel | None = None, prefill_step_limit_s: float | None = None,
    ) -> None:  # fmt: skip
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.step_cost = step_cost or StepCostModel()
        """Predicts a step's seconds for time-per-token targets (the engine's live fit)."""
        self.prefill_step_limit_s = prefill_step_limit_s
        self.waiting: list[Request] = []  # sorted by Request.sort_key
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._arrivals = itertools.count()

    def add(self, request: Request) -> None:
        """Queue a new request; it runs in (priority, arrival) order."""
        request.arrival = next(self._arrivals)
        self._enqueue(request)

    def has_unfinished(self) -> bool:
        """Anything waiting or running."""
        return bool(self.waiting or self.running)

    def schedule(self, drafts: Mapping[Request, Proposal] | None = None) -> SchedulerOutput:
        """Hand out this step's token budget; `drafts` (from the speculator) ride as lookahead."""
        out = SchedulerOutput()
        drafts = drafts or {}
        for request in self.running:
            proposal = drafts.get(request)
            request.spec_token_ids = list(proposal.token_ids) if proposal is not None else []
        self._make_room_for_urgent(out)
        targets = StepTargets.of(
            self.running, self.waiting, self.step_cost, self.prefill_step_limit_s
        )
        # Decodes first: they cost one token (1 + k with drafts) each, and a long
        # prefill taking the whole budget must not stall everyone's next token.
        # Requests with a time-per-token target go before those without.
        for request in sorted(self.running, key=_step_order):
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            budget = self._budget(request, out, targets)
            if budget == 0:
                continue
            num_new = self._reserve(request, budget, out)
            if num_new:
                out.num_new_tokens[request] = num_new
        while self.waiting and len(self.running) < self.max_num_seqs:
            budget = self._budget(self.waiting[0], out, targets)
            if budget == 0 or self.waiting[0] in out.preempted:
                break  # a request evicted for room this step would only thrash
            if self._admit(self.waiting[0], budget, out) == 0:
                break
        out.drafts = {
            request: dataclasses.replace(drafts[request], token_ids=request.spec_token_ids)
            for request in out.num_new_tokens
            if request.spec_token_ids
        }
        return out

    def update(self, scheduled: SchedulerOutput, result: RunnerOutput) -> dict[Request, list[int]]:
        """Advance every request of the step; return the tokens each sampling request kept.

        Blocks are named for the prefix cache before anything can finish and free them.
        A failed request advances nothing (its K/V may be garbage, so its blocks are never
        named) and finishes with `error`; an embedding request finishes once pooled. Sampled
        tokens are appended up to the first stop token or the length limit, then lookahead
        past the newest token (rejected drafts) is rolled back."""
        for request, num_new in scheduled.num_new_tokens.items():
            if request not in result.failed:
                request.num_computed_tokens += num_new
                self.kv.cache_full_blocks(request)
        kept: dict[Request, list[int]] = {}
        for request in result.failed:
            kept[request] = []
            self.finish(request, "error")
        for request in result.embeddings:  # prefill done: an embedding request's only step
            kept[request] = []
            self.finish(request, "stop")
        for request, token_ids in result.sampled_token_ids.items():
            kept[request], reason = _append(request, token_ids)
            self._roll_back_lookahead(request)
            if reason is not None:
                self.finish(request, reason)
        return kept

    def finish(self, request: Request, reason: str) -> None:
        """Take a request out of scheduling for good and free its blocks (`stop`, `length`,
        `abort`, `error`); finishing a finished request is a no-op."""
        if request.status == RequestStatus.FINISHED:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def _roll_back_lookahead(self, request: Request) -> None:
        """Only tokens before the newest one have valid K/V: drop rejected drafts' slots."""
        request.spec_token_ids = []
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        self.kv.trim(request, request.num_computed_tokens)

    def _enqueue(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)

    def _budget(self, request: Request, out: SchedulerOutput, targets: StepTargets) -> int:
        """Tokens `request` may compute this step: what is left of the token budget, cut
        to what keeps the step within its time limits (see the module docstring)."""
        budget = self.max_num_batched_tokens - out.total_tokens
        if budget == 0 or targets.decode_is_due(request):
            return budget
        if targets.prompt_ahead_of(request):
            return 0
        step = (len(out.num_new_tokens) + 1, out.total_tokens, out.attended_positions)
        has_prefill = any(r.is_prefilling for r in out.num_new_tokens)
        return min(budget, targets.tokens_in_time(request, step, has_prefill))

    def _make_room_for_urgent(self, out: SchedulerOutput) -> None:
        """A full batch yields its least urgent member to a strictly higher priority."""
        while (
            self.waiting
            and len(self.running) >= self.max_num_seqs
            and self.waiting[0].priority < self._least_urgent().priority
        ):
            self._preempt(self._least_urgent(), out)

    def _reserve(self, request: Request, budget: int, out: SchedulerOutput) -> int:
        """Blocks for the tokens `request` lacks (cut to `budget`); returns how many (0: none).

        Draft tokens are the first thing given up: those past the budget are
        dropped, and all of them before anyone is preempted for room. Then the
        least urgent running request is preempted until the rest fits (if it
        was already scheduled this step, it leaves the batch and its tokens
        return to the budget).
        """
        num_new = min(request.num_tokens_with_spec - request.num_computed_tokens, budget)
        num_spec_fitting = request.num_computed_tokens + num_new - request.num_tokens
        del request.spec_token_ids[max(num_spec_fitting, 0) :]
        while not self.kv.can_allocate(request, request.num_computed_tokens + num_new, []):
            if request.spec_token_ids:
                num_new -= len(request.spec_token_ids)
                request.spec_token_ids.clear()
                continue
            victim = self._least_urgent()
            self._preempt(victim, out)
            if victim is request:
                return 0
        self.kv.allocate(request, request.num_computed_tokens + num_new, [])
        return num_new

    def _admit(self, request: Request, budget: int, out: SchedulerOutput) -> int:
        """Move the head of the queue into the batch; return the tokens it was given (0: none)."""
        cached = self.kv.find_cached_prefix(request)
        num_computed = len(cached) * self.kv.block_size
        num_new = min(request.num_tokens_with_spec - num_computed, budget)
        while not self.kv.can_allocate(request, num_computed + num_new, cached):
            if not self.running or request.priority >= self._least_urgent().priority:
                return 0
            self._preempt(self._least_urgent(), out)
        self.waiting.pop(0)
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_computed
        self.kv.allocate(request, num_computed + num_new, cached)
        request.num_computed_tokens = num_computed
        if request.first_scheduled_time_s is None:
            request.first_scheduled_time_s = time.monotonic()
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        out.num_new_tokens[request] = num_new
        return num_new

    def _least_urgent(self) -> Request:
        return max(self.running, key=lambda r: r.sort_key)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        out.num_new_tokens.pop(request, None)
        out.preempted.append(request)
        self._enqueue(request)  # keeps its arrival: it goes back to its place in line


def _append(request: Request, token_ids: list[int]) -> tuple[list[int], str | None]:
    """Append sampled tokens up to the first that ends the request; (kept, reason)."""
    for i, token_id in enumerate(token_ids):
        request.append_output_token(token_id)
        reason = _stop_reason(request, token_id)
        if reason is not None:
            return token_ids[: i + 1], reason
    return list(token_ids), None


def _stop_reason(request: Request, token_id: int) -> str | None:
    """`stop` for a stop or (not ignored) EOS token, `length` at max_tokens, else None."""
    params = request.params
    if token_id in params.stop_token_ids:
        return "stop"
    if token_id in request.eos_token_ids and not params.ignore_eos:
        return "stop"
    if request.num_output_tokens >= params.max_tokens:
        return "length"
    return None


def _step_order(request: Request) -> tuple[bool, bool, tuple[int, int]]:
    """Requests with a target first, then decodes before prefills, then priority and arrival."""
    return (request.tpot_target_s is None, request.is_prefilling, request.sort_key)
