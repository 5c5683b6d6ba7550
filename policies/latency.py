"""Predicted time to first token and time per output token of a request on a pool.

The model follows the engine's scheduler (engine/scheduler.py): sequences of
a more urgent or equal priority are served first, so only they delay a new
request's slot and its prefill; every running sequence, whatever its
priority, shares the decode steps and so sets the time per token, except
that a request with a time-per-token target keeps less urgent work out of
the steps that would overrun it. A step costs
`base + per_seq * sequences + per_token * decode tokens + per_prompt_token * prompt
tokens` seconds, fitted online by each engine (engine/step_cost.py; a prompt token
reads less context than a decode's). Work spreads evenly over replicas.

    slot wait   = the sequences ahead take the slots in order, each for its
                  remaining tokens at TPOT; the wait ends when the next one frees.
                  A prompt without a target also waits for room: it fits in what the
                  decodes leave under the tightest target decoding, and where they
                  leave nothing, until the sequences with a target now in flight finish
    prefill     = steps to compute the prompts ahead (the one being computed half done)
                  and this one, one after another, less what the pool's prefix cache
                  holds of them (at its measured hit rate),
                  each a step with the decodes riding along and a chunk of the budget
                  for prefill (while a sequence with a target decodes, or one with a
                  tighter target than the prompt's is about to, of what the tightest
                  target leaves; never less than a share of the decodes' own time;
                  without a target, within the pool's prefill step limit);
                  with a target, no step holds less urgent decodes without a
                  target, nor a looser target's before it is due (the engine pauses
                  that work until a more urgent request with a target has its first
                  token), so a full batch of batch work costs an interactive
                  request's first token nothing but its preemption
    step running = a request joins at a step boundary: while the pool works, it first waits
                  out the step in progress, on average half of one (its decodes and
                  the prompt tokens pending, up to the budget); while a sequence with
                  a target decodes, the engine keeps every step within that target, and
                  a pool's prefill step limit keeps it within the limit or twice its decodes
    urgent share = the slots more urgent sequences hold: they keep coming, so a less
                  urgent request's slot wait and prefill stretch by 1 / (1 - share)
    TTFT        = step running + slot wait + prefill
    TPOT        = one decode step at the batch the request will run in, stretched by
                  the prompts that keep arriving (their measured share of the time),
                  over the tokens a sequence gains in it; with a target, less urgent
                  work joins only up to it
    speculation = on a pool that drafts, a decoding sequence computes 1 + its drafts
                  in each step and gains 1 + those accepted (the pool's measured
                  means): both the decodes' share of a step and TPOT follow them
    constrained = a request held to a grammar adds its row's mask (measured by each
                  replica, engine/grammar.py) to every step it samples in: once to
                  TTFT, once to TPOT
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from policies.pool_state import InFlightSequence, PoolState

PROMPT_FLOOR_SHARE = 0.5
"""engine.step_targets.PROMPT_FLOOR_SHARE, which the engine applies (policies import no engine;
a test holds the two equal)."""


FIRST_CHUNK_SHARE = 1.0
"""A prompt without a target on a pool with a prefill step limit: a step's first chunk may
take as long as the step's decodes, however far that passes the limit (the engine's
rule, engine/step_targets.py), so it always moves."""


AHEAD_PROMPT_DECODING_SHARE = 0.5
"""Of the steps that prefill a new prompt and the prompts ahead of it, the share in which one
of those prompts ahead decodes, on average: prompts with a target are prefilled one at a
time, so the first of k ahead decodes through k of the k + 1 prefills and the last through
one, k / 2 decodes in all. Counted in every step, the interactive pool's prefill with two
or three prompts ahead was predicted at 11-15 steps against 8-12 taken (bench_sla overload)."""


MAX_URGENT_SHARE = 0.95
"""A less urgent request is predicted to wait at most 20 times as long as the work ahead
of it alone would take (`_urgent_share`): a pool that more urgent work holds whole starves
it for as long as that lasts, which no snapshot of the pool can tell."""


@dataclass(frozen=True)
class Prediction:
    """What a new request would see on a pool."""

    ttft_s: float
    tpot_s: float
    num_ahead: int
    """Sequences of equal or more urgent priority already in flight."""
    slot_wait_s: float = 0.0
    """Of `ttft_s`: the wait for a batch slot, and without a target for room beside the
    decodes with one (the rest is the step in progress and the prefill): the request log
    shows the parts beside the measured hops."""
    prefill_s: float = 0.0
    """Of `ttft_s`: the steps that compute the prompts ahead and this one."""


def predict(
    pool: PoolState,
    priority: int,
    num_prompt_tokens: int,
    tpot_target_s: float | None = None,
    constrained: bool = False,
) -> Prediction:
    """TTFT and TPOT of a new request of `priority` with a `num_prompt_tokens` prompt, which
    the engine is to keep within `tpot_target_s` per token (None: no target), held to a
    grammar when `constrained`."""
    ahead = [s for s in pool.in_flight if s.priority <= priority]
    limit_s = _prefill_limit_s(pool, tpot_target_s)
    floor_share = _floor_share(tpot_target_s, limit_s)
    prefill_batch = _prefill_batch(pool, priority, tpot_target_s, limit_s)
    tpot_s = _decoding_step_s(pool, priority, tpot_target_s, limit_s, floor_share)
    tpot_s /= pool.tokens_gained_per_decode
    wait_s = _slot_wait_s(pool, ahead, tpot_s)
    prefill_tokens = pool.prompt_tokens_computed(
        num_prompt_tokens + _prompt_tokens_left(pool, ahead)
    )
    tokens_per_replica = max(1, math.ceil(prefill_tokens / max(1, pool.num_replicas)))
    if tpot_target_s is None:  # it rides in the room the targets leave, else as a pool limits
        room_wait_s = _room_wait_s(pool, prefill_batch, limit_s)
        wait_s += room_wait_s
        if limit_s is None or room_wait_s > 0:
            limit_s, floor_share = pool.prefill_step_limit_s, FIRST_CHUNK_SHARE
    prefill_s = _prefill_s(pool, tokens_per_replica, prefill_batch, limit_s, floor_share)
    stretch = 1.0 / (1.0 - _urgent_share(pool, priority))
    wait_s, prefill_s = stretch * wait_s, stretch * prefill_s
    mask_s = pool.cost.per_constrained_row_s if constrained else 0.0
    ttft_s = step_in_progress_s(pool) + wait_s + prefill_s + mask_s
    return Prediction(
        ttft_s=ttft_s, tpot_s=tpot_s + mask_s, num_ahead=len(ahead),
        slot_wait_s=wait_s, prefill_s=prefill_s + mask_s,
    )  # fmt: skip


def _decoding_step_s(
    pool: PoolState, priority: int, tpot_target_s: float | None, limit_s: float | None,
    floor_share: float,
) -> float:  # fmt: skip
    """A step the new request decodes in: the batch's decodes, and the chunks of the prompts
    that keep arriving, which take `prompt_time_share` of the time (so the decodes' steps
    stretch by 1 / (1 - share)). With a target, the engine holds that to the target, less
    urgent work riding only up to it, but never cuts the due decodes, and a prompt with
    the tightest target may lengthen them by `floor_share` (all of it where they alone pass
    the target: engine/step_targets.py). Without the arriving prompts, bench_sla's
    interactive pool under overload was predicted 27 ms a token where it gave 39 (1.0x at
    light load), and admitted streams past its SLO."""
    decodes_s = pool.decode_step_s(_batch(pool, len(pool.in_flight) + 1))
    with_prompts = 1.0 / (1.0 - pool.prompt_time_share)
    if tpot_target_s is None:
        return decodes_s * with_prompts
    held_batch = _prefill_batch(pool, priority, tpot_target_s, limit_s, ahead_share=1.0)
    held_s = pool.decode_step_s(held_batch)
    decodes_s = max(held_s, min(decodes_s, tpot_target_s))
    if floor_share > 0 and held_s >= tpot_target_s:  # out of reach: at the decodes' pace
        floor_share = 1.0
    floor_share *= _floored_share(pool, priority)
    prompts_cap_s = max(tpot_target_s, (1.0 + floor_share) * held_s)
    return max(decodes_s, min(decodes_s * with_prompts, prompts_cap_s))


def _floored_share(pool: PoolState, priority: int) -> float:
    """Of the prompts arriving, the share taken to prefill with a floor beside a new request
    of `priority`: those with a target, as urgent or more, as the sequences in flight are
    (all, on an idle pool). The rest ride only in the room the target leaves: the engine gives
    a floor only to the first prompt with a target where no tighter one decodes
    (engine/step_targets.py `floor_share`), never to batch work's prompts, which are most of
    what arrives on the offline pool."""
    if not pool.in_flight:
        return 1.0
    floored = sum(s.tpot_target_s is not None and s.priority <= priority for s in pool.in_flight)
    return floored / len(pool.in_flight)


def step_in_progress_s(pool: PoolState) -> float:
    """What a request arriving now waits for the step in progress, on average (0 when the
    pool is idle): half a step over the batch in flight and the prompt tokens pending, as
    far as the budget takes them. A long prefill step on a busy pool is seconds on a CPU,
    unless the pool limits its prefill steps, or a sequence with a time-per-token target is
    decoding: the engine then keeps each step within the tightest such target (its own
    decodes are never cut, so never below their step)."""
    if not pool.in_flight:
        return 0.0
    replicas = max(1, pool.num_replicas)
    batch = _batch(pool, len(pool.in_flight))
    pending = pool.prompt_tokens_computed(
        sum(s.num_prompt_tokens for s in pool.in_flight if not s.prefilled)
    )
    decode_tokens = pool.decode_tokens(batch)
    prompt_tokens = max(0.0, min(pool.max_num_batched_tokens - decode_tokens, pending / replicas))
    step_s = pool.cost.step_s(batch, decode_tokens, prompt_tokens)
    if pool.prefill_step_limit_s is not None:  # the first chunk may take the decodes' time
        decodes_s = pool.decode_step_s(batch)
        step_s = min(step_s, max(pool.prefill_step_limit_s, 2 * decodes_s))
    targets = [s.tpot_target_s for s in pool.in_flight if s.prefilled and s.tpot_target_s]
    if targets:
        own_decodes = _batch(pool, len(targets))
        step_s = min(step_s, max(min(targets), pool.decode_step_s(own_decodes)))
    return 0.5 * step_s


def _prefill_limit_s(pool: PoolState, tpot_target_s: float | None) -> float | None:
    """The step time a new prompt with `tpot_target_s` is prefilled under: the tightest
    target of the sequences decoding, and of those still prefilling with a tighter target
    than its own (their prompts go first, then they decode beside it). None: no target."""
    own_s = math.inf if tpot_target_s is None else tpot_target_s
    targets = [
        s.tpot_target_s
        for s in pool.in_flight
        if s.tpot_target_s and (s.prefilled or s.tpot_target_s < own_s)
    ]
    return min(targets, default=None)


def drain_s(pool: PoolState, num_sequences: int) -> float:
    """Time for `num_sequences` of the pool's running sequences to finish: how long a
    client refused for a full queue should wait before trying again."""
    batch = min(pool.max_num_seqs, math.ceil(len(pool.in_flight) / max(1, pool.num_replicas)))
    tpot_s = pool.decode_step_s(max(1, batch)) / pool.tokens_gained_per_decode
    return num_sequences / pool.num_slots * _mean_remaining(pool.in_flight) * tpot_s


def _batch(pool: PoolState, num_sequences: int) -> int:
    """Sequences per replica's step when `num_sequences` spread over the pool."""
    return min(pool.max_num_seqs, math.ceil(num_sequences / max(1, pool.num_replicas)))


def _slot_wait_s(pool: PoolState, ahead: Sequence[InFlightSequence], tpot_s: float) -> float:
    """Until a batch slot frees for the new request (0 when one is free now).

    The sequences ahead hold the slots in arrival order: the first `num_slots`
    run, each later one takes the slot that frees first. Sequences that
    started together finish together, which a mean over them would miss.
    """
    if len(ahead) < pool.num_slots:
        return 0.0
    finish_s = [s.num_remaining_tokens * tpot_s for s in ahead[: pool.num_slots]]
    heapq.heapify(finish_s)
    for queued in ahead[pool.num_slots :]:
        heapq.heappush(finish_s, heapq.heappop(finish_s) + queued.num_remaining_tokens * tpot_s)
    return finish_s[0]


def _prefill_s(
    pool: PoolState, num_tokens: int, batch: int, limit_s: float | None, floor_share: float
) -> float:
    """Steps to compute `num_tokens` prompt tokens on one replica, each beside `batch - 1`
    decodes, each chunk within the token budget and within `limit_s` (`_chunk`)."""
    num_decodes = batch - 1
    chunk = _chunk(pool, num_decodes, limit_s, floor_share)
    num_steps = math.ceil(num_tokens / chunk)
    last_chunk = num_tokens - (num_steps - 1) * chunk
    decode_tokens = pool.decode_tokens(num_decodes)
    full = pool.cost.step_s(batch, decode_tokens, chunk)
    return (num_steps - 1) * full + pool.cost.step_s(batch, decode_tokens, last_chunk)


def _prompt_tokens_left(pool: PoolState, ahead: Sequence[InFlightSequence]) -> float:
    """Prompt tokens still to compute ahead of a new request: the prompts ahead without a
    first token, whole, except the one each replica is computing (the oldest holding a
    slot: prompts with a target go one at a time), which a request arriving at a random
    moment finds half done on average (counted whole, bench_sla's interactive pool was
    predicted a first token 1.5 times as late as it came)."""
    holding_slots = ahead[: pool.num_slots]
    computing = [s for s in holding_slots if not s.prefilled][: max(1, pool.num_replicas)]
    waiting = sum(s.num_prompt_tokens for s in ahead if not s.prefilled)
    return waiting - sum(s.num_prompt_tokens for s in computing) / 2


def _room_wait_s(pool: PoolState, prefill_batch: int, limit_s: float | None) -> float:
    """How long a prompt without a target waits for room: the engine fits such work into
    what the step's decodes leave under the tightest target decoding, so where those
    decodes alone reach `limit_s` it waits until the sequences with a target in flight
    have finished (0 where they leave room, or none has a target). Priced at one token a
    step, bench_sla's standard requests downgraded to its offline pool were predicted a
    first token in 200-450 s, against 6-36 s measured."""
    if limit_s is None or _decodes_beside_prompt_s(pool, prefill_batch - 1) < limit_s:
        return 0.0
    return max(s.num_remaining_tokens * s.tpot_target_s for s in pool.in_flight if s.tpot_target_s)


def _urgent_share(pool: PoolState, priority: int) -> float:
    """The share of the pool's slots that more urgent sequences hold, at most
    MAX_URGENT_SHARE. As long as that work keeps coming (Little's law: what it holds is its
    arrival rate times its time in the pool), it takes those slots, and the steps, first
    again and again: a less urgent request waits and prefills in the rest, which stretches
    both by 1 / (1 - share). Without it, bench_sla's standard requests on an interactive
    pool that its interactive streams kept full were predicted a first token in 4 s that
    came in 8-32 s, their slots taken again each time one freed."""
    more_urgent = sum(s.priority < priority for s in pool.in_flight)
    return min(MAX_URGENT_SHARE, more_urgent / pool.num_slots)


def _floor_share(tpot_target_s: float | None, limit_s: float | None) -> float:
    """The engine's (engine/step_targets.py): a prompt with a target may lengthen a step by
    PROMPT_FLOOR_SHARE of its decodes' time, unless a tighter target than its own holds the
    step."""
    if tpot_target_s is None or (limit_s is not None and tpot_target_s > limit_s):
        return 0.0
    return PROMPT_FLOOR_SHARE


def _prefill_batch(
    pool: PoolState, priority: int, tpot_target_s: float | None, limit_s: float | None,
    ahead_share: float = AHEAD_PROMPT_DECODING_SHARE,
) -> int:  # fmt: skip
    """Sequences per step while a new prompt of `priority` prefills, itself included: with
    `tpot_target_s`, the decodes due in steps held to it (or to a tighter `limit_s`), a
    prompt ahead counted at `ahead_share` (1 once the new request decodes: by then every
    prompt ahead does too); without, every decode and every prompt of equal or more urgent
    priority (less urgent prompts wait: the budget goes to the more urgent first)."""
    if tpot_target_s is None:
        count = sum(s.prefilled or s.priority <= priority for s in pool.in_flight)
    else:
        step_s = min(tpot_target_s, limit_s or math.inf)
        count = _decodes_beside_urgent_prompt(pool, priority, step_s, ahead_share)
    return _batch(pool, count + 1)


def _decodes_beside_urgent_prompt(
    pool: PoolState, priority: int, step_s: float, ahead_share: float
) -> int:
    """The decodes that keep running while a prompt of `priority` prefills in steps held to
    `step_s` (its target, or a tighter one decoding): each with a target in the share of
    those steps where it is due, about `step_s` over its own target (engine/step_targets.py:
    a looser target than the step's decodes once a step more would pass it); one of equal
    or more urgent priority without a target in every step; a prompt ahead, at
    `ahead_share` of that. A less urgent one counts only
    once it decodes, and without a target not at all: it rides in what the prompt leaves.
    Counted as decodes, bench_sla's standard and batch prompts waiting on the offline pool
    priced an interactive request's steps there at 120-150 ms against a 107 ms target that
    the engine kept, and turned it away; counted in every step, the streams beside an
    interactive one left a standard prompt no room, one token a step (150-300 s predicted,
    5-27 s measured)."""
    due = 0.0
    for sequence in pool.in_flight:
        target_s = sequence.tpot_target_s
        if sequence.priority > priority and not sequence.prefilled:
            continue
        if target_s is not None:
            share = min(1.0, step_s / target_s)
        elif sequence.priority <= priority:
            share = 1.0
        else:
            continue
        due += share if sequence.prefilled else ahead_share * share
    return math.ceil(due)


def _chunk(pool: PoolState, num_decodes: int, limit_s: float | None, floor_share: float) -> int:
    """Prompt tokens of one step beside `num_decodes` decodes: what the budget leaves, and
    under a time-per-token limit what the limit leaves, never less than `floor_share` of
    the decodes' own time (all of it when they alone pass the limit; engine/step_targets.py),
    and always at least one token."""
    chunk = max(1, pool.max_num_batched_tokens - math.ceil(pool.decode_tokens(num_decodes)))
    prompt_token_s = pool.cost.prompt_s(1)
    if limit_s is None or prompt_token_s <= 0:
        return chunk
    decodes_s = _decodes_beside_prompt_s(pool, num_decodes)
    if floor_share > 0 and decodes_s >= limit_s:  # out of reach: at the decodes' pace
        floor_share = 1.0
    room_s = max(limit_s - decodes_s, floor_share * decodes_s)
    return max(1, min(chunk, int(room_s / prompt_token_s)))


def _decodes_beside_prompt_s(pool: PoolState, num_decodes: int) -> float:
    """A step of `num_decodes` decodes and a prompt, before the prompt's chunk: the room
    under a limit is what is left of it."""
    return pool.cost.step_s(num_decodes + 1, pool.decode_tokens(num_decodes))


def _mean_remaining(sequences: Sequence[InFlightSequence]) -> float:
    if not sequences:
        return 0.0
    return sum(s.num_remaining_tokens for s in sequences) / len(sequences)
