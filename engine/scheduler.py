"""Continuous batching in vLLM v1's style: one token budget, no phases.

Every step, each running request is given the tokens it still lacks
(`num_tokens_with_spec - num_computed_tokens`), cut to what is left of the
budget: a long prompt gets a chunk, a decoding request gets 1 (or 1 + k when
it speculates). Waiting requests are admitted in (priority, arrival) order
while the batch and the KV pool have room, starting past their cached prefix.
When blocks run out, or a more urgent request waits on a full batch, the
least urgent running request is preempted: its blocks are freed and it is
recomputed from scratch later (with luck, from the prefix cache).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from engine.kv_cache import KVCacheManager
from engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    num_new_tokens: dict[Request, int] = field(default_factory=dict)
    """The requests that run this step, in batch order, and how many tokens each computes."""
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens.values())


class Scheduler:
    def __init__(
        self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Request] = []  # sorted by Request.sort_key
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._make_room_for_urgent(out)
        # Decodes first: they cost one token (1 + k with drafts) each, and a long
        # prefill taking the whole budget must not stall everyone's next token.
        for request in sorted(self.running, key=lambda r: (_is_prefilling(r), r.sort_key)):
            budget = self.max_num_batched_tokens - out.total_tokens
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = self._reserve(request, budget, out)
            if num_new:
                out.num_new_tokens[request] = num_new
        while self.waiting and len(self.running) < self.max_num_seqs:
            budget = self.max_num_batched_tokens - out.total_tokens
            if budget == 0 or self.waiting[0] in out.preempted:
                break  # a request evicted for room this step would only thrash
            if self._admit(self.waiting[0], budget, out) == 0:
                break
        return out

    def finish(self, request: Request, reason: str) -> None:
        """Take a request out of scheduling for good and free its blocks."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

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
        self.add(request)


def _is_prefilling(request: Request) -> bool:
    """More than the newest token left to compute: a prompt (or recomputation) in progress."""
    return request.num_tokens - request.num_computed_tokens > 1
