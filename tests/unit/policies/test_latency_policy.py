"""The latency model on synthetic pool states: pure, milliseconds (and one real
measurement: the grammar mask a constrained request pays)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from engine.grammar import mask_cost_s
from policies.latency import drain_s, predict, step_in_progress_s
from policies.placement import RequestShape, place
from policies.pool_state import MAX_PROMPT_TIME_SHARE, InFlightSequence, PoolState
from testing.synthetic_pools import COST, STANDARD, decoding, pool


def test_a_constrained_request_pays_the_measured_mask_on_each_token(tokenizer):
    """The mask this machine measures for one constrained row (engine/grammar.py) is what a
    constrained request's predicted TPOT, and its first token, cost more; placement
    passes the request's shape through."""
    measured_s = mask_cost_s(tokenizer)
    assert 0 < measured_s < 0.01
    cost = replace(COST, per_constrained_row_s=measured_s)
    busy = replace(pool("fast", decoding(1, 3)), cost=cost)
    free = predict(busy, priority=0, num_prompt_tokens=100)
    held = predict(busy, priority=0, num_prompt_tokens=100, constrained=True)
    assert held.tpot_s - free.tpot_s == pytest.approx(measured_s)
    assert held.ttft_s - free.ttft_s == pytest.approx(measured_s)
    pools = {"fast": busy, "bulk": pool("bulk")}
    placed = place(STANDARD, RequestShape(100, 50, constrained=True), pools)
    assert placed.pool == "fast" and placed.prediction is not None
    expected = predict(busy, STANDARD.priority, 100, STANDARD.tpot_target_s, constrained=True)
    assert placed.prediction.tpot_s == pytest.approx(expected.tpot_s)


def test_idle_pool_predicts_one_prefill_and_a_batch_one_step():
    p = predict(pool("fast"), priority=0, num_prompt_tokens=100)
    assert p.ttft_s == pytest.approx(COST.step_s(1, 100))
    assert p.tpot_s == pytest.approx(COST.step_s(1, 1))
    assert p.num_ahead == 0


def test_long_prompt_is_chunked_by_the_token_budget():
    p = predict(pool("fast"), priority=0, num_prompt_tokens=600)  # 256 + 256 + 88
    expected = 2 * COST.step_s(1, 256) + COST.step_s(1, 88)
    assert p.ttft_s == pytest.approx(expected)


def test_prompts_ahead_delay_the_first_token_but_less_urgent_ones_do_not():
    waiting_batch = [InFlightSequence(2, 500, 100, prefilled=False)]
    urgent_view = predict(pool("bulk", waiting_batch), priority=0, num_prompt_tokens=100)
    batch_view = predict(pool("bulk", waiting_batch), priority=2, num_prompt_tokens=100)
    assert batch_view.ttft_s > urgent_view.ttft_s
    assert urgent_view.num_ahead == 0 and batch_view.num_ahead == 1


def test_the_prompt_being_computed_ahead_counts_half_done():
    """Arriving at a random moment, a request finds the prompt the engine is computing half
    done on average; a prompt still waiting behind it counts whole."""
    computing = InFlightSequence(0, 100, 50, prefilled=False)
    busy = pool("fast", [computing])
    p = predict(busy, priority=0, num_prompt_tokens=100)
    assert p.prefill_s == pytest.approx(COST.step_s(2, 1 + 50 + 100))
    behind = predict(pool("fast", [computing, computing]), priority=0, num_prompt_tokens=100)
    assert behind.prefill_s == pytest.approx(COST.step_s(3, 2 + 50 + 100 + 100))


def test_a_full_batch_makes_a_new_request_wait_for_slots():
    full = pool("fast", decoding(0, 4, remaining=40))
    p = predict(full, priority=0, num_prompt_tokens=10)
    free = predict(pool("fast", decoding(0, 3, remaining=40)), priority=0, num_prompt_tokens=10)
    # All four started together: the first slot frees when they all finish.
    in_progress = step_in_progress_s(full) - step_in_progress_s(pool("fast", decoding(0, 3)))
    assert p.ttft_s - free.ttft_s == pytest.approx(40 * COST.step_s(4, 4) + in_progress)


def test_queued_sequences_take_the_slots_that_free_first():
    running = [InFlightSequence(0, 10, remaining, prefilled=True) for remaining in (10, 20, 30, 40)]
    queued = [InFlightSequence(0, 10, 50, prefilled=False)]
    p = predict(pool("fast", running + queued), priority=0, num_prompt_tokens=10)
    # The queued one takes the slot freed after 10 tokens; this request the next, after 20.
    prefill_s = COST.step_s(4, 3 + 20)  # both prompts computed beside 3 decodes
    in_progress = 0.5 * COST.step_s(4, 4 + 10)  # four decoding, one prompt pending
    assert p.ttft_s == pytest.approx(in_progress + 20 * p.tpot_s + prefill_s, rel=1e-6)
    assert (p.slot_wait_s, p.prefill_s) == pytest.approx((20 * p.tpot_s, prefill_s))


def test_a_target_keeps_less_urgent_work_out_of_the_time_per_token():
    bulk = pool("bulk", decoding(2, 60), max_num_seqs=64)
    untargeted = predict(bulk, priority=0, num_prompt_tokens=10)
    targeted = predict(bulk, priority=0, num_prompt_tokens=10, tpot_target_s=0.025)
    assert untargeted.tpot_s == pytest.approx(COST.step_s(61, 61))
    assert targeted.tpot_s == pytest.approx(0.025)
    tight = predict(bulk, priority=0, num_prompt_tokens=10, tpot_target_s=0.001)
    assert tight.tpot_s == pytest.approx(COST.step_s(1, 1))  # out of reach: alone at best


def test_prompts_that_keep_arriving_stretch_the_time_per_token_within_the_targets_rules():
    """The decodes' steps stretch by 1 / (1 - the share of the time arriving prompts take):
    here 1,200 prompt tokens a second at 0.5 ms, 0.6 of it. With a target, the steps stay
    within it, except that a prompt with that target may lengthen the due decodes by
    PROMPT_FLOOR_SHARE of theirs (by all of it where they alone pass the target), if the
    prompts arriving are like those in flight, with a target; without one, they only fill
    the room the target leaves."""

    def busy(target_s: float | None) -> PoolState:
        streams = [replace(s, tpot_target_s=target_s) for s in decoding(0, 3)]
        return replace(pool("fast", streams), prompt_tokens_per_s=1200.0)

    assert busy(None).prompt_time_share == pytest.approx(0.6)
    decodes_s = COST.step_s(4, 4)  # 16 ms
    stretched_s = decodes_s / 0.4
    assert predict(busy(None), 0, 10).tpot_s == pytest.approx(stretched_s)
    for target_s, expected_s in ((0.1, stretched_s), (0.018, 1.5 * decodes_s),
                                 (0.001, 2 * decodes_s)):  # fmt: skip
        assert predict(busy(target_s), 0, 10, target_s).tpot_s == pytest.approx(expected_s)
    assert predict(busy(None), 0, 10, 0.018).tpot_s == pytest.approx(0.018)  # room only
    flooded = replace(busy(None), prompt_tokens_per_s=1e6)
    assert flooded.prompt_time_share == MAX_PROMPT_TIME_SHARE
    assert predict(flooded, 0, 10).tpot_s == pytest.approx(decodes_s / (1 - MAX_PROMPT_TIME_SHARE))


def test_a_target_keeps_less_urgent_decodes_out_of_its_prompts_steps():
    bulk = replace(pool("bulk", decoding(2, 60), max_num_seqs=64), max_num_batched_tokens=1024)
    untargeted = predict(bulk, priority=0, num_prompt_tokens=128)
    targeted = predict(bulk, priority=0, num_prompt_tokens=128, tpot_target_s=0.025)
    in_progress = 0.5 * COST.step_s(60, 60)  # the batch's decode step: waited out either way
    assert untargeted.ttft_s == pytest.approx(in_progress + COST.step_s(61, 60 + 128))
    assert targeted.ttft_s == pytest.approx(in_progress + COST.step_s(1, 128))  # held back
    # A prompt longer than the budget: the batch's decodes stay out of every chunk.
    long = predict(bulk, priority=0, num_prompt_tokens=1500, tpot_target_s=0.025)
    then = COST.step_s(1, 1024) + COST.step_s(1, 476)
    assert long.ttft_s == pytest.approx(in_progress + then)


def test_less_urgent_decodes_with_a_target_run_beside_an_urgent_prompt_when_due():
    """Only decodes that are due run beside an urgent prompt: a looser target's in about
    the urgent target over its own of the steps (six standard streams at 20 times the
    urgent target: one step in 20 each, so one decode a step between them), work without
    a target in none."""
    standard = [replace(s, tpot_target_s=0.5) for s in decoding(1, 6)]  # loose: no chunking
    mixed = pool("bulk", standard + decoding(2, 20), max_num_seqs=64)
    targeted = predict(mixed, priority=0, num_prompt_tokens=128, tpot_target_s=0.025)
    in_progress = step_in_progress_s(mixed)
    assert targeted.ttft_s == pytest.approx(in_progress + COST.step_s(2, 1 + 128))
    tight = replace(mixed, in_flight=tuple(replace(s, tpot_target_s=0.025) for s in standard))
    as_tight = predict(tight, priority=0, num_prompt_tokens=128, tpot_target_s=0.025)
    assert as_tight.ttft_s > targeted.ttft_s  # as tight: due in every step


def test_a_looser_prompt_beside_a_tighter_stream_gets_no_floor():
    """An interactive stream decoding at its target: a standard prompt's chunks take only
    what that target leaves (the engine never stretches the stream's steps for it), so its
    first token is predicted later than an equally tight prompt's."""
    chat = [replace(s, tpot_target_s=0.012) for s in decoding(0, 1)]  # its step alone: 12 ms
    busy = pool("bulk", chat, max_num_seqs=8)
    tight = predict(busy, priority=0, num_prompt_tokens=64, tpot_target_s=0.012)
    loose = predict(busy, priority=1, num_prompt_tokens=64, tpot_target_s=0.5)
    assert loose.ttft_s > 2 * tight.ttft_s


def test_replicas_share_the_load():
    one = predict(pool("fast", decoding(0, 8)), priority=0, num_prompt_tokens=10)
    two = predict(pool("fast", decoding(0, 8), replicas=2, max_num_seqs=8), 0, 10)
    assert two.tpot_s < one.tpot_s or two.ttft_s < one.ttft_s


def test_drain_time_grows_with_the_backlog():
    busy = pool("fast", decoding(0, 4, remaining=30))
    assert drain_s(busy, 4) == pytest.approx(2 * drain_s(busy, 2))


def test_a_request_waits_out_the_step_in_progress_on_a_busy_pool():
    """A request joins at a step boundary: on a pool computing a full prefill budget it
    first waits half such a step, on average; an idle pool makes it wait for nothing."""
    prefilling = [InFlightSequence(2, 2000, 64, prefilled=False)]
    bulk = replace(pool("bulk", prefilling), max_num_batched_tokens=1024)
    assert step_in_progress_s(pool("bulk")) == 0.0
    assert step_in_progress_s(bulk) == pytest.approx(0.5 * COST.step_s(1, 1024))
    urgent = predict(bulk, priority=0, num_prompt_tokens=100)  # nothing ahead of it but the step
    prefill_s = COST.step_s(1, 100)  # its prompt: the other, still a prompt, decodes nothing
    assert urgent.ttft_s == pytest.approx(step_in_progress_s(bulk) + prefill_s)


def test_a_decoding_target_bounds_the_step_a_request_waits_out():
    """While a sequence with a time-per-token target decodes, the engine keeps every step
    within that target (engine/scheduler.py), so the step in progress is no longer than it,
    however much prompt is pending; never shorter than the targeted decodes' own step."""
    prefilling = [InFlightSequence(2, 2000, 64, prefilled=False)]
    targeted = [InFlightSequence(1, 100, 50, prefilled=True, tpot_target_s=0.1)]
    bulk = replace(pool("bulk", prefilling + targeted), max_num_batched_tokens=1024)
    assert step_in_progress_s(bulk) == pytest.approx(0.5 * 0.1)
    untargeted = replace(bulk, in_flight=(*prefilling, replace(targeted[0], tpot_target_s=None)))
    assert step_in_progress_s(untargeted) == pytest.approx(0.5 * COST.step_s(2, 1024))
    tight = replace(bulk, in_flight=(*prefilling, replace(targeted[0], tpot_target_s=1e-6)))
    assert step_in_progress_s(tight) == pytest.approx(0.5 * COST.step_s(1, 1))
    waiting = replace(bulk, in_flight=(*prefilling, replace(targeted[0], prefilled=False)))
    assert step_in_progress_s(waiting) == pytest.approx(0.5 * COST.step_s(2, 1024))


def test_a_prefill_step_limit_bounds_the_step_a_request_waits_out():
    """The engine cuts prefill to the limit, its first chunk to no less than the decodes'
    time: the step in progress lasts the limit, or at most twice the decodes."""
    prefilling = [InFlightSequence(2, 2000, 64, prefilled=False)]
    bulk = replace(pool("bulk", prefilling + decoding(2, 3)), max_num_batched_tokens=1024)
    unlimited = step_in_progress_s(bulk)
    assert step_in_progress_s(replace(bulk, prefill_step_limit_s=0.05)) == pytest.approx(0.025)
    assert step_in_progress_s(replace(bulk, prefill_step_limit_s=1e-6)) == pytest.approx(
        COST.step_s(4, 4)
    )
    assert step_in_progress_s(replace(bulk, prefill_step_limit_s=100.0)) == unlimited


def test_a_decoding_target_cuts_a_prompt_into_chunks_within_it():
    """Beside a stream decoding at a time-per-token target, the engine prefills a prompt in
    chunks that keep each step within the target: a prompt that one step of the budget
    computes takes several, and the prediction counts each step's decodes again."""
    targeted = [InFlightSequence(0, 100, 50, prefilled=True, tpot_target_s=0.03)]
    free = pool("fast", decoding(0, 1))
    held = pool("fast", targeted)
    prompt = 200  # one step of the 256-token budget alone: 0.010 + 0.002 + 0.1005 s
    free_ttft = predict(free, 0, prompt).ttft_s - step_in_progress_s(free)
    assert free_ttft == pytest.approx(COST.step_s(2, 1 + prompt))
    held_ttft = predict(held, 0, prompt).ttft_s - step_in_progress_s(held)
    chunk = int((0.03 - COST.step_s(2, 1)) / COST.per_token_s)  # 35 tokens a step
    steps = -(-prompt // chunk)
    assert held_ttft == pytest.approx(COST.step_s(2, 1) * steps + COST.per_token_s * prompt)


def test_a_prompt_token_cheaper_than_a_decode_token_is_chunked_at_its_own_cost():
    """Beside a stream held to a target, the room each step leaves is cut into prompt tokens
    at what a prompt token costs (it reads only the prompt so far), not a decode's."""
    targeted = [InFlightSequence(0, 100, 50, prefilled=True, tpot_target_s=0.03)]
    cheap_prompts = replace(COST, per_prompt_token_s=COST.per_token_s / 2)
    held = pool("fast", targeted)
    held_cheap = replace(held, cost=cheap_prompts)
    room_s = 0.03 - COST.step_s(2, 1)
    chunk = int(room_s / COST.per_token_s)
    cheap_chunk = int(room_s / cheap_prompts.per_prompt_token_s)
    assert cheap_chunk >= 2 * chunk
    prompt = 200
    ttft = predict(held, 0, prompt).ttft_s - step_in_progress_s(held)
    cheap_ttft = predict(held_cheap, 0, prompt).ttft_s - step_in_progress_s(held_cheap)
    steps, cheap_steps = -(-prompt // chunk), -(-prompt // cheap_chunk)
    assert cheap_steps < steps
    decodes_s = COST.step_s(2, 1)
    assert cheap_ttft == pytest.approx(decodes_s * cheap_steps + cheap_prompts.prompt_s(prompt))
    assert ttft == pytest.approx(decodes_s * steps + COST.prompt_s(prompt))


def test_prompts_ahead_decode_beside_a_new_prompt_for_half_its_wait():
    """Two interactive prompts ahead are prefilled one at a time, then decode: over the
    prefills up to the new prompt's, they decode beside it one at a time on average, so
    the steps leave the room that one more decoding stream leaves, not two more. (Of
    their 200 tokens, 150 are left: the one being computed is half done.)"""
    stream = InFlightSequence(0, 100, 50, prefilled=True, tpot_target_s=0.05)
    ahead = [replace(stream, prefilled=False)] * 2
    with_prompts_ahead = predict(pool("fast", [stream, *ahead]), 0, 100, 0.05)
    one_more_stream = predict(pool("fast", [stream, stream]), 0, 100 + 150, 0.05)
    assert with_prompts_ahead.prefill_s == pytest.approx(one_more_stream.prefill_s)
    two_more_streams = predict(pool("fast", [stream] * 3), 0, 100 + 150, 0.05)
    assert two_more_streams.prefill_s > with_prompts_ahead.prefill_s
    slow = replace(COST, per_seq_s=0.02)  # a step of the three streams passes the target
    held = predict(replace(pool("fast", [stream, *ahead]), cost=slow), 0, 100, 0.05)
    streams = predict(replace(pool("fast", [stream] * 3), cost=slow), 0, 100, 0.05)
    assert held.tpot_s == streams.tpot_s > 0.05  # it decodes once they all do


def test_a_prompt_behind_a_tighter_target_in_flight_gets_only_the_room_it_leaves():
    """An interactive sequence still prefilling decodes within a few steps, at its target:
    a standard prompt (a looser target) behind it is predicted in the chunks that target
    leaves, without the floor an as-tight prompt keeps."""
    urgent = InFlightSequence(0, 10, 50, prefilled=False, tpot_target_s=0.02)
    held = pool("fast", [urgent])
    free = pool("fast", [replace(urgent, tpot_target_s=None)])
    standard = predict(held, 1, 200, tpot_target_s=0.5).ttft_s
    assert standard > predict(free, 1, 200, tpot_target_s=0.5).ttft_s
    as_tight = predict(held, 0, 200, tpot_target_s=0.02).ttft_s
    assert as_tight < standard  # the floor: a chunk as long as the decodes, whatever the target


def test_a_speculating_pool_prices_its_decodes_drafts_and_gains_what_is_accepted():
    """Each decode computes 1 + 3 drafts and gains 2 tokens a step: TPOT is a step of four
    tokens a sequence over two, and a prompt's chunk gets the budget the drafts leave."""
    plain = pool("fast", decoding(0, 2))
    drafting = replace(plain, tokens_computed_per_decode=4.0, tokens_gained_per_decode=2.0)
    assert predict(plain, 0, 10).tpot_s == pytest.approx(COST.step_s(3, 3))
    assert predict(drafting, 0, 10).tpot_s == pytest.approx(COST.step_s(3, 12) / 2)
    prompt = predict(drafting, 0, 256)  # beside 2 decodes' 8 tokens: 248 fit the first step
    in_progress = step_in_progress_s(drafting)
    first, second = COST.step_s(3, 8 + 248), COST.step_s(3, 8 + 8)
    assert prompt.ttft_s == pytest.approx(in_progress + first + second)


def test_less_urgent_prompts_waiting_are_no_decodes_beside_an_urgent_request():
    """Standard prompts still waiting for their first token decode nothing: an interactive
    request's steps hold the two standard streams that decode (due every other step), and
    less urgent work fills them only up to its target, whatever the queue behind."""
    standard = [replace(s, tpot_target_s=0.05) for s in decoding(1, 2)]
    waiting = [replace(s, prefilled=False) for s in standard * 10]
    busy = pool("bulk", standard + waiting, max_num_seqs=64)
    queued = predict(busy, priority=0, num_prompt_tokens=64, tpot_target_s=0.025)
    assert COST.step_s(1 + 10 + 1, 12) > 0.025  # the queue counted as decodes would pass it
    assert queued.tpot_s == pytest.approx(0.025)


def test_slots_held_by_more_urgent_work_stretch_a_less_urgent_first_token():
    """Three of four slots held by interactive streams: a standard request waits and
    prefills in the quarter they leave (they keep coming), four times as long as beside
    three standard streams that hold the same slots; an interactive request is not slowed."""
    urgent = pool("fast", decoding(0, 3))
    equal = pool("fast", decoding(1, 3))
    in_progress = step_in_progress_s(urgent)
    assert in_progress == pytest.approx(step_in_progress_s(equal))
    behind = predict(urgent, priority=1, num_prompt_tokens=100)
    beside = predict(equal, priority=1, num_prompt_tokens=100)
    assert behind.ttft_s - in_progress == pytest.approx(4 * (beside.ttft_s - in_progress))
    assert behind.prefill_s == pytest.approx(4 * beside.prefill_s)
    first = predict(equal, priority=0, num_prompt_tokens=100)
    assert first.ttft_s == pytest.approx(predict(urgent, priority=0, num_prompt_tokens=100).ttft_s)


def test_a_pool_full_of_more_urgent_work_predicts_a_bounded_wait():
    """Every slot held by more urgent work: the wait is long but finite (MAX_URGENT_SHARE)."""
    full = pool("fast", decoding(0, 4))
    starved = predict(full, priority=1, num_prompt_tokens=100)
    assert math.isfinite(starved.ttft_s)
    assert starved.ttft_s > 10 * predict(pool("fast"), 1, 100).ttft_s


def test_looser_streams_beside_a_prompt_count_in_the_steps_where_they_are_due():
    """A standard prompt beside an interactive stream (30 ms steps) and standard streams at
    500 ms: each standard stream is due in about 6% of those steps, so eight of them leave
    the prompt the room one does (the engine lets the rest ride only where room is left)."""
    chat = [replace(s, tpot_target_s=0.03) for s in decoding(0, 1)]
    standard = [replace(s, tpot_target_s=0.5) for s in decoding(1, 8)]
    eight = pool("bulk", chat + standard, max_num_seqs=64)
    one = pool("bulk", chat + standard[:1], max_num_seqs=64)
    crowded = predict(eight, priority=1, num_prompt_tokens=128, tpot_target_s=0.5)
    alone = predict(one, priority=1, num_prompt_tokens=128, tpot_target_s=0.5)
    assert crowded.prefill_s == pytest.approx(alone.prefill_s)
    assert COST.step_s(1 + 8 + 1, 9) > COST.step_s(3, 2)  # counted whole, less room was left


def test_prompt_tokens_the_prefix_cache_holds_are_not_predicted_computed():
    """A pool whose prefix cache held a quarter of the prompt tokens it looked up prefills a
    128-token prompt, and the one ahead of it, as 96-token prompts on a pool without."""
    ahead = [InFlightSequence(0, 128, 64, prefilled=False)]
    cached = replace(pool("fast", ahead), prompt_share_computed=0.75)
    uncached = pool("fast", [replace(ahead[0], num_prompt_tokens=96)])
    assert predict(cached, 0, 128).ttft_s == pytest.approx(predict(uncached, 0, 96).ttft_s)
    assert predict(cached, 0, 128).ttft_s < predict(pool("fast", ahead), 0, 128).ttft_s


def test_a_prompt_without_a_target_waits_while_targeted_decodes_fill_the_steps():
    """Four interactive streams held to 12 ms, whose decodes alone take 17 ms a step: a
    downgraded 400-token prompt gets no room until they finish (50 tokens at 12 ms), then
    prefills in whole chunks, not a token a step (400 steps, about 8 s)."""
    chat = [replace(s, tpot_target_s=0.012) for s in decoding(0, 4)]
    busy = pool("bulk", chat, max_num_seqs=64)
    assert COST.step_s(5, 4) > 0.012
    downgraded = predict(busy, priority=1, num_prompt_tokens=400)
    stretch = 1 / (1 - 4 / 64)  # the interactive streams keep coming
    assert downgraded.slot_wait_s == pytest.approx(stretch * 50 * 0.012)
    chunks = COST.step_s(5, 4 + 252) + COST.step_s(5, 4 + 148)
    assert downgraded.prefill_s == pytest.approx(stretch * chunks)


def test_a_prompt_without_a_target_takes_chunks_within_the_pools_prefill_step_limit():
    """On a pool that limits prefill steps to 50 ms, a prompt without a target beside four
    decodes (17 ms) takes 33 ms of tokens a step, and at least the decodes' own time where
    the limit leaves less (the engine's rule: it always moves)."""
    limited = replace(pool("bulk", decoding(1, 4), max_num_seqs=64), prefill_step_limit_s=0.05)
    chunk = int((0.05 - COST.step_s(5, 4)) / COST.per_token_s)
    steps = math.ceil(200 / chunk)
    last = 200 - (steps - 1) * chunk
    expected = (steps - 1) * COST.step_s(5, 4 + chunk) + COST.step_s(5, 4 + last)
    assert predict(limited, 1, 200).prefill_s == pytest.approx(expected)
    tight = replace(limited, prefill_step_limit_s=0.001)
    floor = int(COST.step_s(5, 4) / COST.per_token_s)
    assert predict(tight, 1, floor).prefill_s == pytest.approx(COST.step_s(5, 4 + floor))
