"""Time-per-token targets in the scheduler: a request with a target shares a step only as far
as the step, predicted by the step-cost fit, stays within it."""

from __future__ import annotations

import pytest
from test_scheduler import FakeModel, make_scheduler, scheduled

from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.step_cost import StepCostModel, StepWork

BASE_S, PER_SEQ_S, PER_TOKEN_S = 0.010, 0.001, 0.001
TARGET_S = 0.020


def fitted_cost() -> StepCostModel:
    """A step-cost fit trained on exact synthetic steps: base 10 ms, 1 ms per seq and token."""
    model = StepCostModel()
    for num_seqs in range(1, 9):
        for num_tokens in (num_seqs, num_seqs + 40, num_seqs + 200):
            seconds = BASE_S + PER_SEQ_S * num_seqs + PER_TOKEN_S * num_tokens
            model.observe(StepWork(num_seqs, num_tokens), seconds)
    return model


def with_cost(**kwargs) -> Scheduler:
    scheduler = make_scheduler(**kwargs)
    scheduler.step_cost = fitted_cost()
    return scheduler


def request(name: str, prompt_len: int, priority: int, target_s: float | None) -> Request:
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    return Request(name, list(range(1, prompt_len + 1)), params, priority, target_s)


def predicted_s(scheduler: Scheduler, tokens: dict[str, int]) -> float:
    base, per_seq, per_token, _ = scheduler.step_cost.coefficients()
    return base + per_seq * len(tokens) + per_token * sum(tokens.values())


def test_fit_recovers_the_synthetic_step_cost():
    base, per_seq, per_token, _ = fitted_cost().coefficients()
    assert abs(base - BASE_S) < 1e-4 and abs(per_seq - PER_SEQ_S) < 1e-4
    assert abs(per_token - PER_TOKEN_S) < 1e-4


def batch_decoding(num_requests: int) -> tuple[Scheduler, FakeModel]:
    """A scheduler whose `num_requests` batch requests (no target) have prefilled."""
    scheduler = with_cost(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64)
    model = FakeModel(scheduler)
    for i in range(num_requests):
        scheduler.add(request(f"batch{i}", 2, priority=2, target_s=None))
    model.step()  # every batch request prefilled: all decode from now on
    return scheduler, model


def test_batch_decodes_join_a_target_only_while_the_step_fits_it():
    scheduler, model = batch_decoding(6)
    scheduler.add(request("chat", 2, priority=0, target_s=TARGET_S))
    model.step()  # chat admitted (its prefill); now it decodes too
    tokens = scheduled(model.step())
    assert "chat" in tokens
    assert predicted_s(scheduler, tokens) <= TARGET_S + 1e-4
    assert 1 <= len(tokens) - 1 < 6, "some, not all, batch decodes ride along"


def test_a_stream_behind_its_target_takes_the_riders_out_until_it_catches_up():
    """The target is the client's mean time per token: a stream whose tokens took longer
    than their target (a core another pool took) asks the next steps for less, down to half
    its target, and the batch decodes riding along give way."""
    scheduler, model = batch_decoding(6)
    chat = request("chat", 2, priority=0, target_s=TARGET_S)
    scheduler.add(chat)
    model.step()
    assert len(scheduled(model.step())) > 1, "on time: batch rides along"
    assert chat.first_token_time_s is not None
    chat.first_token_time_s -= 1.0  # its tokens so far took a second more than their target
    assert scheduled(model.step()) == {"chat": 1}


def test_a_step_budget_is_the_target_less_what_the_stream_is_behind():
    chat = request("chat", 2, priority=0, target_s=0.1)
    for token_id in (7, 8, 9):  # the first token, then two: two gaps so far, three after the next
        chat.append_output_token(token_id)
    assert chat.first_token_time_s is not None
    first_s = chat.first_token_time_s
    assert chat.step_budget_s(first_s + 0.15) == pytest.approx(0.1)  # ahead: never above it
    assert chat.step_budget_s(first_s + 0.22) == pytest.approx(0.08)  # behind by 20 ms
    assert chat.step_budget_s(first_s + 0.9) == pytest.approx(0.05)  # at least half of it
    assert request("batch", 2, priority=2, target_s=None).step_budget_s(first_s) is None


def test_without_targets_every_decode_runs():
    _, model = batch_decoding(6)
    assert len(scheduled(model.step())) == 6


def test_an_urgent_request_with_a_target_waiting_takes_the_step_from_batch_decodes():
    scheduler, model = batch_decoding(3)
    scheduler.add(request("chat", 30, priority=0, target_s=TARGET_S))
    assert scheduled(model.step()) == {"chat": 30}


def test_batch_decodes_stay_out_until_the_urgent_prompt_has_its_first_token():
    scheduler, model = batch_decoding(3)
    scheduler.add(request("chat", 150, priority=0, target_s=TARGET_S))
    assert scheduled(model.step()) == {"chat": 64}  # the budget: the prompt is chunked
    assert scheduled(model.step()) == {"chat": 64}, "still prefilling: batch stays paused"
    assert scheduled(model.step()) == {"chat": 22}
    tokens = scheduled(model.step())  # chat decodes: batch rides along within its target
    assert "chat" in tokens and len(tokens) > 1


def test_a_long_prompt_beside_decoding_streams_is_cut_to_the_streams_target():
    scheduler = with_cost(num_blocks=256, max_num_seqs=4, max_num_batched_tokens=512)
    model = FakeModel(scheduler)
    for i in range(3):
        scheduler.add(request(f"stream{i}", 2, priority=0, target_s=0.2))
    model.step()
    scheduler.add(request("document", 400, priority=0, target_s=0.2))
    tokens = scheduled(model.step())
    assert {f"stream{i}" for i in range(3)} <= tokens.keys()
    assert 0 < tokens["document"] < 400
    assert predicted_s(scheduler, tokens) <= 0.2 + 1e-3


def test_a_prefill_keeps_its_floor_when_the_target_is_out_of_reach():
    scheduler = with_cost(num_blocks=256, max_num_seqs=4, max_num_batched_tokens=512)
    model = FakeModel(scheduler)
    scheduler.add(request("stream", 2, priority=0, target_s=0.001))  # faster than any step
    model.step()
    scheduler.add(request("document", 400, priority=0, target_s=0.001))
    # The rest of the step: 10 ms base + 2 sequences + 1 token = 13 ms, already past the
    # target; a token costs 1 ms: the prompt moves at the stream's pace, 13 tokens.
    assert scheduled(model.step()) == {"stream": 1, "document": 13}


def test_a_chunk_late_in_a_long_prompt_is_cut_shorter_than_an_early_one():
    """Each prompt token reads its whole context: the fit's attention term shrinks later
    chunks, so the streams beside the prompt keep their target all the way."""
    scheduler = make_scheduler(num_blocks=512, max_num_seqs=4, max_num_batched_tokens=2048)
    scheduler.step_cost = StepCostModel()
    for num_seqs, num_tokens, attended in [(1, 1, 10), (4, 4, 4000), (1, 256, 70_000),
                                           (2, 512, 400_000), (3, 100, 150_000)] * 20:  # fmt: skip
        seconds = BASE_S + PER_SEQ_S * num_seqs + PER_TOKEN_S * num_tokens + 1e-7 * attended
        scheduler.step_cost.observe(StepWork(num_seqs, num_tokens, attended), seconds)
    model = FakeModel(scheduler)
    for i in range(3):
        scheduler.add(request(f"stream{i}", 2, priority=0, target_s=0.2))
    model.step()
    scheduler.add(request("document", 1500, priority=0, target_s=0.2))
    chunks: list[int] = []
    while sum(chunks) < 1500:
        tokens = scheduled(model.step())
        assert {f"stream{i}" for i in range(3)} <= tokens.keys()
        chunks.append(tokens["document"])
    assert sum(chunks) == 1500
    assert chunks[0] > chunks[len(chunks) // 2] > chunks[-2] > 0


def limited(limit_s: float) -> tuple[Scheduler, FakeModel]:
    """A scheduler with a prefill step limit, and the fitted 10 ms + 1 ms a token cost."""
    scheduler = with_cost(num_blocks=256, max_num_seqs=8, max_num_batched_tokens=512)
    scheduler.prefill_step_limit_s = limit_s
    return scheduler, FakeModel(scheduler)


def test_a_prefill_step_limit_cuts_prompts_without_targets_to_it():
    """The offline pool's long prefill steps: a batch prompt no longer takes the whole token
    budget in one step, so an urgent arrival waits out a short step; yet it moves."""
    scheduler, model = limited(0.1)
    scheduler.add(request("document", 400, priority=2, target_s=None))
    scheduler.add(request("second", 400, priority=2, target_s=None))
    tokens = scheduled(model.step())
    # 10 ms base + 1 sequence = 11 ms, then 1 ms a token: 89 tokens (less the fit's
    # rounding); no room for "second".
    assert tokens.keys() == {"document"} and 87 <= tokens["document"] <= 89
    assert predicted_s(scheduler, tokens) <= 0.1 + 1e-4
    drain_steps = 0
    while scheduler.has_unfinished():
        assert predicted_s(scheduler, scheduled(model.step())) <= 0.1 + 1e-3
        drain_steps += 1
    assert drain_steps < 200


def test_a_prefill_limit_below_the_decodes_step_still_gives_one_chunk_their_time():
    scheduler, model = limited(0.005)  # shorter than any step
    for i in range(4):
        scheduler.add(request(f"batch{i}", 2, priority=2, target_s=None))
    while len(scheduled(model.step())) < 4:
        pass  # one prompt a step (each the step's first chunk) until all four decode
    scheduler.add(request("document", 400, priority=2, target_s=None))
    scheduler.add(request("second", 400, priority=2, target_s=None))
    tokens = scheduled(model.step())
    # The rest of the step: 10 ms base + 5 sequences + 4 decode tokens = 19 ms: 19 tokens
    # (less the fit's rounding), and none for "second".
    assert tokens.keys() == {*(f"batch{i}" for i in range(4)), "document"}
    assert 17 <= tokens["document"] <= 19


def test_without_a_prefill_limit_a_prompt_takes_the_whole_budget():
    scheduler, model = limited(0.1)
    scheduler.prefill_step_limit_s = None
    scheduler.add(request("document", 400, priority=2, target_s=None))
    assert scheduled(model.step()) == {"document": 400}


def test_a_looser_target_gives_way_to_the_tightest_until_its_own_is_due():
    """An interactive request overflowed beside standard ones: the standard decodes (a
    looser target) leave the steps that would overrun the interactive target, and come back
    once a step more would pass their own."""
    scheduler = with_cost(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64)
    model = FakeModel(scheduler)
    chat = request("chat", 2, priority=0, target_s=0.013)  # alone: 10 + 1 + 1 = 12 ms
    standard = request("standard", 2, priority=1, target_s=1.0)
    scheduler.add(standard)
    model.step()  # standard prefilled: it decodes from now on
    scheduler.add(chat)
    model.step()  # chat's prompt beside standard's decode
    assert scheduled(model.step()) == {"chat": 1}  # the two together: 14 ms
    assert standard.last_token_time_s is not None
    standard.last_token_time_s -= 0.995  # one more 13 ms step would pass its second
    assert scheduled(model.step()) == {"chat": 1, "standard": 1}
    assert scheduled(model.step()) == {"chat": 1}


def test_a_looser_decode_not_yet_due_steps_aside_for_an_urgent_prompt():
    """An interactive prompt overflowed beside a standard stream: the standard decode, with
    time to spare before its own target, leaves the prompt's steps (the prompt's floor is
    then a share of the due decodes alone), and comes back once a step more would pass it."""
    scheduler = with_cost(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=512)
    model = FakeModel(scheduler)
    standard = request("standard", 2, priority=1, target_s=1.0)
    scheduler.add(standard)
    model.step()  # standard prefilled: it decodes from now on
    chat = request("chat", 40, priority=0, target_s=0.02)
    scheduler.add(chat)
    assert scheduled(model.step())["chat"] == 40  # standard, the tightest decoding, is due
    scheduler.add(request("chat2", 300, priority=0, target_s=0.02))
    tokens = scheduled(model.step())  # standard would fit: 14 ms
    assert "standard" not in tokens and tokens["chat"] == 1 and 0 < tokens["chat2"] < 300
    assert standard.last_token_time_s is not None
    standard.last_token_time_s -= 0.995  # one more step would pass its own target
    assert "standard" in scheduled(model.step())


def test_the_prefill_step_limit_leaves_prompts_with_a_target_to_their_target():
    """An urgent prompt is the work the limit makes room for: it is not held to it."""
    scheduler, model = limited(0.02)
    scheduler.add(request("chat", 300, priority=0, target_s=0.05))
    assert scheduled(model.step()) == {"chat": 300}


def test_a_looser_targets_prompt_takes_only_the_room_the_tightest_target_leaves():
    """A standard prompt beside an overflowed interactive stream: it fills what is left of
    the stream's target and, when nothing is, still moves, but lengthens the stream's step
    by half at most; a more urgent prompt arriving then goes first."""
    scheduler = with_cost(num_blocks=256, max_num_seqs=8, max_num_batched_tokens=512)
    model = FakeModel(scheduler)
    chat = request("chat", 2, priority=0, target_s=0.05)
    scheduler.add(chat)
    model.step()
    scheduler.add(request("standard", 400, priority=1, target_s=1.0))
    roomy = scheduled(model.step())
    assert 0 < roomy["standard"] < 400 and predicted_s(scheduler, roomy) <= 0.05 + 1e-3
    chat.tpot_target_s = 0.0135  # its decode alone (12 ms) leaves no room for a token
    tight = scheduled(model.step())
    assert tight["chat"] == 1 and tight["standard"] >= 1
    assert predicted_s(scheduler, tight) <= 1.5 * predicted_s(scheduler, {"chat": 1}) + 2e-3
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    scheduler.add(Request("chat2", list(range(1000, 1030)), params, 0, 0.0135))  # no prefix
    assert scheduled(model.step())["chat2"] >= 6  # the first prompt: half the decode's time


def test_prompts_with_a_target_arriving_together_are_prefilled_one_at_a_time():
    """A burst of interactive prompts overflowed to a pool with nothing decoding: the first
    token of the first comes after its own prompt, not after all of them (one step of the
    whole budget would give every one of them the slowest first token)."""
    scheduler = with_cost(num_blocks=256, max_num_seqs=8, max_num_batched_tokens=512)
    model = FakeModel(scheduler)
    for i in range(3):
        scheduler.add(request(f"chat{i}", 100, priority=0, target_s=0.5))
    assert scheduled(model.step()) == {"chat0": 100}
    assert "chat1" in scheduled(model.step())


def test_only_the_first_prompt_keeps_the_floor():
    """Two prompts as tight as the stream decoding beside them: the first may take half as
    long as the decode, the second only what the target leaves; it does not lengthen the
    step again."""
    scheduler = with_cost(num_blocks=256, max_num_seqs=8, max_num_batched_tokens=512)
    model = FakeModel(scheduler)
    chat = request("chat", 2, priority=0, target_s=0.0135)
    scheduler.add(chat)
    model.step()  # chat decodes; its step alone (12 ms) leaves no room at its target
    for i in range(2):
        scheduler.add(request(f"next{i}", 100, priority=0, target_s=0.0135))
    tokens = scheduled(model.step())
    assert tokens.get("next0", 0) >= 6 and "next1" not in tokens
    assert predicted_s(scheduler, tokens) <= 1.5 * predicted_s(scheduler, {"chat": 1}) + 2e-3


def test_a_looser_prompt_never_stretches_a_tighter_streams_step():
    """An interactive stream decoding at its target (its step alone leaves no room) beside a
    standard prompt with a looser target: the prompt takes a token a step instead of the
    half-step floor a prompt as tight as the stream gets, so the stream keeps its target."""
    scheduler = with_cost(num_blocks=256, max_num_seqs=8, max_num_batched_tokens=512)
    model = FakeModel(scheduler)
    scheduler.add(request("chat", 2, priority=0, target_s=0.0135))
    model.step()
    scheduler.add(request("standard", 100, priority=1, target_s=0.5))
    tokens = scheduled(model.step())
    assert tokens == {"chat": 1, "standard": 1}
