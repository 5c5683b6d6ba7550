"""The time limits one step must respect: time-per-token targets and the prefill step limit.

Requests may carry a time-per-token target (`Request.tpot_target_s`). Their
decodes are scheduled first and run whenever they are due: at once for the
tightest target in the step, and for a looser one once a step more would pass
it; until then a looser target's decode rides along like work without one.
The rest of the step (prefill chunks, decodes without a target, looser
targets not yet due) is kept within the tightest target among them, predicted
by the engine's fitted step cost (which knows that a chunk late in a long
prompt costs more than an early one: it reads more context).

A chunk is cut to what fits. Prompts with a target go one at a time, the most
urgent first (`_first_prompt`): the first is never cut below the tokens
predicted to take half as long as the rest of the step (PROMPT_FLOOR_SHARE;
as long, where the rest alone passes the target), so it always moves, even on
a machine too slow for the target, and the streams beside it run at most half
over their time per token meanwhile where the target is in reach. Not so where
a tighter target than its own decodes: it then takes what that target leaves,
at least a token a step, and never stretches the tighter stream's steps; the
others take only the room left, and none while nothing with a target decodes,
so a burst of urgent prompts gets its first tokens one prompt apart rather
than all after every prompt. Work that is not due (without a target, or a
looser target's decode before it is due) joins only as far as the step still
fits, and not at all while a more urgent request with a target is still short
of its first token (waiting, or prefilling its prompt): batch work and
standard decodes with time to spare are paused for an urgent prompt's whole
prefill, not only its first chunk, so on a pool full of them an interactive
request's first token costs the same as on an idle one, and the prompt's
floor is a share of the due decodes only, not of riders that first filled the
step to the target.

A target is kept as the client measures it, on the mean since the first token:
a stream behind its target (steps slower than predicted, on a core another
pool took) lowers the limit of the next steps until it has caught up
(`Request.step_budget_s`), so what rides along gives way; a stream ahead of
it never raises the limit past its target.

A pool that urgent work overflows to may also limit in time the prefill of
work without a target (`prefill_step_limit_s`), by the same rule: chunks are
cut to the limit, the step's first chunk never below its decodes' time. A
request arriving mid-step then waits out a short step rather than a whole
token budget of prefill.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from engine.request import Request
from engine.step_cost import StepCostModel

Step = tuple[int, int, int]
"""A step so far, as the step-cost fit reads it: sequences, tokens, attended positions."""

PROMPT_FLOOR_SHARE = 0.5
"""The first prompt with a target may lengthen a step by this share of its other work when
the targets leave it less room: it always moves, and the streams beside it run at most half
over their target while it prefills (at 1, a prompt beside decodes taking two thirds of the
target took every step a third over it). Where the step's other work alone passes the target
(a machine too slow for it), the whole of it: the target is out of reach either way, and the
prompt moves at the streams' pace."""


@dataclass(frozen=True)
class StepTargets:
    """The time limits one step must respect, read once per `schedule`: the tightest
    time-per-token target decoding, and the prefill step limit."""

    limit_s: float | None
    """What this step may take: the least step budget among the running requests that
    decode with a target (`Request.step_budget_s`: their target, less what they are behind
    it); None when none does."""
    tightest_target_s: float | None
    """The tightest target among them: which decodes are due, and which prompt keeps its
    floor, go by targets, not by how far behind a stream is."""
    urgent_prompt_priority: int | None
    """The most urgent priority among requests with a target still short of their first
    token, waiting or prefilling (None: none)."""
    first_prompt: Request | None
    """The prompt with a target that goes first (`_first_prompt`): only it may take more
    than the room the step has left."""
    step_cost: StepCostModel
    prefill_step_limit_s: float | None

    @classmethod
    def of(
        cls, running: list[Request], waiting: list[Request], step_cost: StepCostModel,
        prefill_step_limit_s: float | None,
    ) -> StepTargets:  # fmt: skip
        """The targets of this step's running and waiting requests."""
        now_s = time.monotonic()
        decoding = [r for r in running if r.tpot_target_s and not r.is_prefilling]
        budgets = [r.step_budget_s(now_s) or 0.0 for r in decoding]
        targets = [r.tpot_target_s or 0.0 for r in decoding]
        prompts = [r for r in running if r.is_prefilling] + waiting
        urgent = [r.priority for r in prompts if r.tpot_target_s is not None]
        return cls(
            min(budgets, default=None), min(targets, default=None), min(urgent, default=None),
            _first_prompt(running, waiting), step_cost, prefill_step_limit_s,
        )  # fmt: skip

    def decode_is_due(self, request: Request) -> bool:
        """`request` decodes with a target this step whatever else the step holds: its target
        is the tightest, or one more step at the tightest would pass it."""
        target_s = request.tpot_target_s
        if target_s is None or request.is_prefilling:
            return False
        tightest_s = self.tightest_target_s
        if tightest_s is None or target_s <= tightest_s or request.last_token_time_s is None:
            return True
        return time.monotonic() - request.last_token_time_s + (self.limit_s or 0.0) >= target_s

    def floor_share(self, request: Request) -> float:
        """How long `request`'s prompt chunk may take past the step's target, as a share of
        the rest of the step: PROMPT_FLOOR_SHARE for the first prompt with a target when no
        tighter target decodes; none for any other. A second prompt waits its turn instead
        of lengthening the step again, and a less urgent prompt never stretches a tighter
        stream's steps (a standard prompt held an interactive stream overflowed to the
        offline pool at 1.5 times its target): it moves by what the target leaves."""
        target_s = request.tpot_target_s
        if request is not self.first_prompt or target_s is None:
            return 0.0
        if self.tightest_target_s is not None and target_s > self.tightest_target_s:
            return 0.0
        return PROMPT_FLOOR_SHARE

    def prompt_ahead_of(self, request: Request) -> bool:
        """A more urgent request with a target is short of its first token: it takes this
        step's room from `request` (unless `request` decodes with a target that is due)."""
        priority = self.urgent_prompt_priority
        return priority is not None and priority < request.priority

    def tokens_in_time(self, request: Request, step: Step, has_prefill: bool) -> int:
        """Tokens `request` may add to the step and keep it predicted within the tightest
        target decoding and, for a prompt without a target, within the prefill step limit;
        the step's first prefill chunk never below the step's decodes' time. Prompts with a
        target go one at a time while nothing with a target decodes: each first token
        comes after one prompt's prefill, not after all of them. `step` is the step so far
        with `request` counted in it; `has_prefill`, whether it holds a prompt's chunk."""
        context = request.num_computed_tokens
        allowed = sys.maxsize
        if self.limit_s is not None:
            allowed = self._within(self.limit_s, step, context, self.floor_share(request))
            if request is self.first_prompt:
                allowed = max(allowed, 1)  # it moves, at least a token a step
        elif request.is_prefilling and request.tpot_target_s is not None:
            allowed = sys.maxsize if request is self.first_prompt else 0
        limited = request.tpot_target_s is None and request.is_prefilling
        if self.prefill_step_limit_s is not None and limited:
            first_chunk = float(not has_prefill)
            in_limit = self._within(self.prefill_step_limit_s, step, context, first_chunk)
            allowed = min(allowed, in_limit)
        return allowed

    def _within(self, limit_s: float, step: Step, context: int, floor_share: float) -> int:
        """Prompt tokens that keep `step` predicted within `limit_s`; with a `floor_share`,
        never fewer than that share of the step's other work is predicted to take (all of
        it when that work alone passes `limit_s`; at least 1), so a prompt moves."""
        cost = self.step_cost
        in_time = cost.tokens_within(limit_s, *step, context)
        if floor_share <= 0:
            return in_time
        other_s = cost.step_s(*step)
        share = 1.0 if other_s >= limit_s else floor_share
        return max(in_time, 1, cost.tokens_in(share * other_s, context))


def _first_prompt(running: list[Request], waiting: list[Request]) -> Request | None:
    """The most urgent prompt with a target already prefilling; the head of the queue
    instead when it has a target and is strictly more urgent (it is admitted this step,
    preempting for room, so the one it passes cannot starve behind it)."""
    prefilling = [r for r in running if r.tpot_target_s is not None and r.is_prefilling]
    first = min(prefilling, key=lambda r: r.sort_key, default=None)
    head = waiting[0] if waiting else None
    if head is None or head.tpot_target_s is None:
        return first
    return head if first is None or head.priority < first.priority else first
