"""Continuous batching in vLLM v1's style: one token budget, no phases.

Every step, each running request is given the tokens it still lacks
(`num_tokens_with_spec - num_computed_tokens`), cut to what is left of the
budget: a long prompt gets a chunk, a decoding request gets 1 (or 1 + k when
it speculates). Waiting requests are admitted in (priority, arrival) order
while the batch and the KV pool have room, starting past their cached prefix.
When blocks run out, or a more urgent request waits on a full batch, the
least urgent running request is preempted: its blocks are freed and it is
recomputed from scratch later (with luck, from the prefix cache).

Requests may carry a time-per-token target (`Request.tpot_target_s`). Their
decodes are scheduled first and run whenever they are due: at once for the
tightest target in the step, and for a looser one once a step more would pass
it; until then a looser target's decode rides along like work without one.
The rest of the step (prefill chunks, decodes without a target, looser
targets not yet due) is kept within the tightest target among them,
predicted by the engine's fitted step cost (which knows that a chunk late in
a long prompt costs more than an early one: it reads more context).
A chunk is cut to what fits. Prompts with a target go one at a time, the most
urgent first (`_first_prompt`): the first is never cut below the tokens
predicted to take half as long as the rest of the step (PROMPT_FLOOR_SHARE),
so it always moves, even on a machine too slow for the target, and the
streams beside it run at most half over their time per token meanwhile; the
others take only the room left, and none while nothing with a target decodes,
so a burst of urgent prompts gets its first tokens one prompt apart rather
than all after every prompt. Work without a target joins only as far as the step
still fits, and not at all while a more urgent request with a target waits.
This is what lets an interactive request share a pool with a big batch, and a
long prompt share a step with streams that are decoding.

A pool that urgent work overflows to may also limit in time the prefill of
work without a target (`prefill_step_limit_s`), by the same rule: chunks are
cut to the limit, the step's first chunk never below its decodes' time. A request
arriving mid-step then waits out a short step rather than a whole token budget
of prefill.

After the forward pass, `update` is the one place request state advances:
computed tokens, naming full blocks for the prefix cache, appending sampled
tokens up to a stop token or the length limit, rolling back rejected draft
lookahead, and finishing.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.kv_cache import KVCacheManager
from engine.outputs import RunnerOutput
from engine.request import Request, RequestStatus
from engine.step_cost import StepCostModel

if TYPE_CHECKING:
    from engine.spec_decode import Proposal

PROMPT_FLOOR_SHARE = 0.5
"""The first prompt with a target may lengthen a step by this share of its other work when
the targets leave it less room: it always moves, and the streams beside it run at most half
over their target while it prefills (at 1, a prompt beside decodes taking two thirds of the
target took every step a third over it)."""


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
        return sum(n * (r.num_computed_tokens + n) for r, n in self.num_new_tokens.items())


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
        targets = _StepTargets.of(
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

    def _budget(self, request: Request, out: SchedulerOutput, targets: _StepTargets) -> int:
        """Tokens `request` may compute this step: what is left of the token budget, cut
        to what keeps the step within its time limits (see the module docstring)."""
        budget = self.max_num_batched_tokens - out.total_tokens
        if budget == 0 or targets.decode_is_due(request):
            return budget
        if request.tpot_target_s is None and targets.waits_ahead_of(request):
            return 0
        return min(budget, targets.tokens_in_time(request, out))

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


@dataclass(frozen=True)
class _StepTargets:
    """The time limits one step must respect, read once per `schedule`: the tightest
    time-per-token target decoding, and the prefill step limit."""

    limit_s: float | None
    """The tightest target among the running requests that decode (None: none)."""
    waiting_priority: int | None
    """The most urgent priority among waiting requests with a target (None: none)."""
    first_prompt: Request | None
    """The prompt with a target that goes first (`_first_prompt`): only it may take more
    than the room the step has left."""
    step_cost: StepCostModel
    prefill_step_limit_s: float | None

    @classmethod
    def of(
        cls, running: list[Request], waiting: list[Request], step_cost: StepCostModel,
        prefill_step_limit_s: float | None,
    ) -> _StepTargets:  # fmt: skip
        """The targets of this step's running and waiting requests."""
        decoding = [r.tpot_target_s for r in running if r.tpot_target_s and not _is_prefilling(r)]
        queued = [r.priority for r in waiting if r.tpot_target_s is not None]
        return cls(
            min(decoding, default=None), min(queued, default=None),
            _first_prompt(running, waiting), step_cost, prefill_step_limit_s,
        )  # fmt: skip

    def decode_is_due(self, request: Request) -> bool:
        """`request` decodes with a target this step whatever else the step holds: its target
        is the tightest, or one more step at the tightest would pass it."""
        target_s = request.tpot_target_s
        if target_s is None or _is_prefilling(request):
            return False
        if self.limit_s is None or target_s <= self.limit_s or request.last_token_time_s is None:
            return True
        return time.monotonic() - request.last_token_time_s + self.limit_s >= target_s

    def floor_share(self, request: Request) -> float:
        """How long `request`'s prompt chunk may take past the step's target, as a share of
        the rest of the step: PROMPT_FLOOR_SHARE for the first prompt with a target, none
        for any other (a second prompt waits its turn instead of lengthening the step
        again)."""
        if request is not self.first_prompt or request.tpot_target_s is None:
            return 0.0
        return PROMPT_FLOOR_SHARE

    def waits_ahead_of(self, request: Request) -> bool:
        """A more urgent request with a target is waiting: it takes this step's room."""
        return self.waiting_priority is not None and self.waiting_priority < request.priority

    def tokens_in_time(self, request: Request, out: SchedulerOutput) -> int:
        """Tokens `request` may add to the step and keep it predicted within the tightest
        target decoding and, for a prompt without a target, within the prefill step limit;
        the step's first prefill chunk never below the step's decodes' time. Prompts with a
        target go one at a time while nothing with a target decodes: each first token
        comes after one prompt's prefill, not after all of them."""
        step = (len(out.num_new_tokens) + 1, out.total_tokens, out.attended_positions)
        context = request.num_computed_tokens
        allowed = sys.maxsize
        if self.limit_s is not None:
            allowed = self._within(self.limit_s, step, context, self.floor_share(request))
        elif _is_prefilling(request) and request.tpot_target_s is not None:
            allowed = sys.maxsize if request is self.first_prompt else 0
        limited = request.tpot_target_s is None and _is_prefilling(request)
        if self.prefill_step_limit_s is not None and limited:
            first_chunk = not any(map(_is_prefilling, out.num_new_tokens))
            in_limit = self._within(self.prefill_step_limit_s, step, context, float(first_chunk))
            allowed = min(allowed, in_limit)
        return allowed

    def _within(
        self, limit_s: float, step: tuple[int, int, int], context: int, floor_share: float
    ) -> int:
        """Prompt tokens that keep `step` predicted within `limit_s`; with a `floor_share`,
        never fewer than that share of the step's other work is predicted to take (at least
        1), so a prompt moves."""
        cost = self.step_cost
        in_time = cost.tokens_within(limit_s, *step, context)
        if floor_share <= 0:
            return in_time
        return max(in_time, 1, cost.tokens_in(floor_share * cost.step_s(*step), context))


def _first_prompt(running: list[Request], waiting: list[Request]) -> Request | None:
    """The most urgent prompt with a target already prefilling; the head of the queue
    instead when it has a target and is strictly more urgent (it is admitted this step,
    preempting for room, so the one it passes cannot starve behind it)."""
    prefilling = [r for r in running if r.tpot_target_s is not None and _is_prefilling(r)]
    first = min(prefilling, key=lambda r: r.sort_key, default=None)
    head = waiting[0] if waiting else None
    if head is None or head.tpot_target_s is None:
        return first
    return head if first is None or head.priority < first.priority else first


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
    return (request.tpot_target_s is None, _is_prefilling(request), request.sort_key)


def _is_prefilling(request: Request) -> bool:
    """More than the newest token left to compute: a prompt (or recomputation) in progress."""
    return request.num_tokens - request.num_computed_tokens > 1
