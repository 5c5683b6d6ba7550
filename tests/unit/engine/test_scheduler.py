"""The scheduler driven by a fake model: budget, batch cap, priorities, preemption, no leaks."""

from __future__ import annotations

import itertools

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.kv_cache import KVCacheManager
from engine.outputs import RunnerOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from testing.engine_helpers import (
    assert_all_blocks_free,
    assert_books_balance,
    assert_slots_hold_tokens,
    forget_fresh_blocks,
    write_slots,
)

BLOCK_SIZE = 4


class FakeModel:
    """Stands in for the runner: 'computes' scheduled tokens into a slot -> token map.

    The next token is a function of the last two, as a greedy model's would be,
    so identical prompts produce identical outputs and their blocks are shared.
    """

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.slot_tokens: dict[int, int] = {}
        forget_fresh_blocks(scheduler.kv, self.slot_tokens)

    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        result = RunnerOutput()
        for request, num_new in out.num_new_tokens.items():
            start = request.num_computed_tokens
            write_slots(self.slot_tokens, request, start, start + num_new, BLOCK_SIZE)
            if start + num_new == request.num_tokens:
                result.sampled_token_ids[request] = [sum(request.token_ids[-2:]) % 3]
        self.scheduler.update(out, result)
        return out


def make_scheduler(
    num_blocks: int = 16, max_num_seqs: int = 4, max_num_batched_tokens: int = 8
) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=True)
    return Scheduler(kv, max_num_seqs, max_num_batched_tokens)


def make_request(
    request_id: str, prompt: list[int], max_tokens: int = 4, priority: int = 0
) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), priority)


def drain(model: FakeModel, max_steps: int = 400) -> None:
    for _ in range(max_steps):
        if not model.scheduler.has_unfinished():
            return
        model.step()
    raise AssertionError("requests stuck: deadlock or livelock")


def run_alone(prompt: list[int], max_tokens: int) -> list[int]:
    model = FakeModel(make_scheduler())
    request = make_request("alone", prompt, max_tokens)
    model.scheduler.add(request)
    drain(model)
    return request.output_token_ids


def scheduled(out: SchedulerOutput) -> dict[str, int]:
    return {request.request_id: n for request, n in out.num_new_tokens.items()}


# ---- behaviour on hand-made cases ----------------------------------------------


def test_long_prompt_is_chunked_while_decodes_keep_flowing():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    model = FakeModel(scheduler)
    scheduler.add(make_request("short", [1, 2], max_tokens=8))
    assert scheduled(model.step()) == {"short": 2}
    scheduler.add(make_request("long", list(range(20))))
    assert scheduled(model.step()) == {"short": 1, "long": 7}
    assert scheduled(model.step()) == {"short": 1, "long": 7}
    assert scheduled(model.step()) == {"short": 1, "long": 6}
    assert scheduled(model.step()) == {"short": 1, "long": 1}  # both decoding now


def test_batch_is_capped_at_max_num_seqs_and_queue_is_fifo():
    scheduler = make_scheduler(max_num_seqs=2)
    model = FakeModel(scheduler)
    for name in "abc":
        scheduler.add(make_request(name, [1]))
    assert scheduled(model.step()) == {"a": 1, "b": 1}
    assert [r.request_id for r in scheduler.waiting] == ["c"]


def test_higher_priority_preempts_the_latest_lowest_priority_on_a_full_batch():
    scheduler = make_scheduler(max_num_seqs=2)
    model = FakeModel(scheduler)
    early, late = make_request("early", [1], priority=1), make_request("late", [1], priority=1)
    scheduler.add(early)
    scheduler.add(late)
    model.step()
    scheduler.add(make_request("urgent", [2, 2], priority=0))
    out = model.step()
    assert [r.request_id for r in out.preempted] == ["late"]
    assert scheduled(out) == {"early": 1, "urgent": 2}
    assert (late.status, late.num_computed_tokens, late.block_ids) == (RequestStatus.WAITING, 0, [])


def test_equal_priority_never_preempts_for_a_full_batch():
    scheduler = make_scheduler(max_num_seqs=1)
    model = FakeModel(scheduler)
    scheduler.add(make_request("first", [1]))
    model.step()
    scheduler.add(make_request("second", [1]))
    out = model.step()
    assert (out.preempted, scheduled(out)) == ([], {"first": 1})


def test_out_of_blocks_preempts_the_least_urgent_and_it_resumes_later():
    scheduler = make_scheduler(num_blocks=3, max_num_batched_tokens=16)
    model = FakeModel(scheduler)
    first, second = make_request("first", [1] * 4, 6), make_request("second", [2] * 4, 6)
    scheduler.add(first)
    scheduler.add(second)
    model.step()  # 2 blocks used, each request now needs a second block: one must yield
    out = model.step()
    assert out.preempted == [second]
    assert second.num_preemptions == 1 and scheduler.num_preemptions == 1
    drain(model)
    assert second.output_token_ids == run_alone([2] * 4, 6)  # recomputed, same result
    assert (first.finish_reason, second.finish_reason) == ("length", "length")
    assert_all_blocks_free(scheduler.kv)


def test_request_with_a_cached_prefix_computes_only_the_rest():
    scheduler = make_scheduler(max_num_batched_tokens=32)
    model = FakeModel(scheduler)
    prefix = [0, 1, 2, 0, 1, 2, 0, 1]  # two full blocks
    scheduler.add(make_request("first", prefix + [2, 2], max_tokens=1))
    model.step()
    second = make_request("second", prefix + [1, 1, 1], max_tokens=1)
    scheduler.add(second)
    assert scheduled(model.step()) == {"second": 3}
    assert second.num_cached_tokens == 8
    assert scheduler.kv.num_hits == 8


# ---- property test -------------------------------------------------------------

MAX_NUM_SEQS = 3
MAX_NUM_BATCHED_TOKENS = 6


class SchedulerMachine(RuleBasedStateMachine):
    """Random arrivals (with priorities), steps, aborts; a tight pool forces preemption."""

    def __init__(self) -> None:
        super().__init__()
        # 7 blocks of 4 = 28 slots: one request (<= 18 tokens) always fits, three rarely do.
        self.scheduler = make_scheduler(7, MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS)
        self.model = FakeModel(self.scheduler)
        self.ids = (f"r{i}" for i in itertools.count())

    @property
    def live(self) -> list[Request]:
        return self.scheduler.running + self.scheduler.waiting

    @rule(
        prompt=st.lists(st.integers(0, 2), min_size=1, max_size=12),
        max_tokens=st.integers(1, 6),
        priority=st.integers(0, 2),
    )
    def arrive(self, prompt: list[int], max_tokens: int, priority: int) -> None:
        self.scheduler.add(make_request(next(self.ids), prompt, max_tokens, priority))

    @rule()
    def step(self) -> None:
        out = self.model.step()
        assert all(num_new > 0 for num_new in out.num_new_tokens.values())
        assert out.total_tokens <= MAX_NUM_BATCHED_TOKENS
        # A request preempted in this step may only be scheduled if it was re-admitted.
        assert all(r.status != RequestStatus.WAITING for r in out.num_new_tokens)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(sorted(self.live, key=lambda r: r.request_id)))
        self.scheduler.finish(request, "abort")
        assert request.block_ids == [] and request.is_finished

    @invariant()
    def batch_is_capped(self) -> None:
        assert len(self.scheduler.running) <= MAX_NUM_SEQS

    @invariant()
    def queues_are_consistent(self) -> None:
        waiting = self.scheduler.waiting
        assert waiting == sorted(waiting, key=lambda r: r.sort_key)
        assert all(r.status == RequestStatus.WAITING and not r.block_ids for r in waiting)
        assert all(r.status == RequestStatus.RUNNING for r in self.scheduler.running)

    @invariant()
    def books_balance(self) -> None:
        assert_books_balance(self.scheduler.kv, self.live)

    @invariant()
    def computed_slots_hold_their_tokens(self) -> None:
        for request in self.scheduler.running:
            assert_slots_hold_tokens(self.model.slot_tokens, request, BLOCK_SIZE)

    def teardown(self) -> None:
        """No deadlock: with no more arrivals everything finishes, and every block comes back."""
        drain(self.model)
        assert_all_blocks_free(self.scheduler.kv)


SchedulerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestSchedulerMachine = SchedulerMachine.TestCase
