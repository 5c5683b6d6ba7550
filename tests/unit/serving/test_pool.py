"""The pool deployment's class, without Ray: health checks, load reports, the deltas it
sends, and the student it serves with the router beside it, over a fake engine."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from engine.config import EngineConfig
from engine.model.students import CARD_FILE, ROUTER_FILE, StudentMissing, students_dir
from engine.outputs import RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams
from policies.difficulty import FEATURE_NAMES, DifficultyModel, StudentIdentity
from policies.router_choice import ServedStudent
from serving.pools.pool import NewSequence, Pool
from serving.pools.served_student import pin_student
from testing.fakes import FakeEngine, publish_fake_student


@pytest.fixture
def pool() -> Pool:
    return Pool.func_or_class(EngineConfig(), FakeEngine)


def test_check_health_passes_while_the_engine_loop_runs(pool: Pool) -> None:
    pool.check_health()


def test_check_health_fails_when_the_engine_loop_is_dead(pool: Pool) -> None:
    pool._engine.alive = False
    with pytest.raises(RuntimeError, match="not running"):
        pool.check_health()


def test_routing_and_autoscaling_stats_report_the_engine_load(pool: Pool) -> None:
    expected = {"num_waiting": 0, "num_running": 0, "kv_cache_usage": 0.0}
    assert pool.record_routing_stats() == {**expected, "max_num_seqs": EngineConfig().max_num_seqs}
    assert pool.record_autoscaling_stats() == expected


def _deltas(pool: Pool, stream: bool, max_tokens: int = 5) -> list[RequestOutput]:
    """What the pool sends the ingress for one request (the fake writes a, b, c, ...)."""
    params = SamplingParams(max_tokens=max_tokens)
    request = NewSequence("r", [1, 2, 3], params, priority=0, stream=stream)

    async def read() -> list[RequestOutput]:
        return [output async for output in pool.generate(request)]

    return asyncio.run(read())


def test_a_streamed_request_gets_every_delta(pool: Pool) -> None:
    deltas = _deltas(pool, stream=True)
    assert [d.new_text for d in deltas] == ["a", "b", "c", "d", "e"]


def test_an_unstreamed_request_gets_its_first_token_then_the_rest_at_once(
    pool: Pool,
) -> None:
    deltas = _deltas(pool, stream=False)
    assert [d.new_text for d in deltas] == ["a", "bcde"]
    assert deltas[1].new_token_ids == [ord(c) for c in "bcde"]
    assert (deltas[1].finished, deltas[1].finish_reason, deltas[1].num_output_tokens) == (
        True, "length", 5,
    )  # fmt: skip


def test_an_unstreamed_one_token_request_gets_one_delta(pool: Pool) -> None:
    deltas = _deltas(pool, stream=False, max_tokens=1)
    assert [(d.new_text, d.finished) for d in deltas] == [("a", True)]


def test_joined_deltas_keep_the_first_ones_prompt_data_and_the_last_ones_ending() -> None:
    first = RequestOutput(
        "r", [7], "x", finished=False, new_logprobs=[TokenLogprob(-0.5)],
        prompt_logprobs=[None, TokenLogprob(-1.0)], num_prompt_tokens=2,
        num_output_tokens=1, queue_time_s=0.25,
    )  # fmt: skip
    last = RequestOutput(
        "r", [8, 9], "yz", finished=True, finish_reason="stop",
        new_logprobs=[TokenLogprob(-0.1), TokenLogprob(-0.2)], num_output_tokens=3,
    )  # fmt: skip
    joined = first.then(last)
    assert (joined.new_token_ids, joined.new_text) == ([7, 8, 9], "xyz")
    assert joined.new_logprobs == [TokenLogprob(-0.5), TokenLogprob(-0.1), TokenLogprob(-0.2)]
    assert joined.prompt_logprobs == first.prompt_logprobs
    assert (joined.num_prompt_tokens, joined.queue_time_s) == (2, 0.25)
    assert (joined.finished, joined.finish_reason, joined.num_output_tokens) == (True, "stop", 3)


def test_joined_deltas_without_logprobs_have_none() -> None:
    a = RequestOutput("r", [1], "a", finished=False, num_output_tokens=1)
    b = RequestOutput("r", [2], "b", finished=False, num_output_tokens=2)
    assert a.then(b).new_logprobs is None


def test_a_pool_of_a_missing_student_waits_then_serves(tmp_path) -> None:
    config = EngineConfig(model="student", cache_dir=tmp_path)
    waiting = Pool.func_or_class(config, FakeEngine)
    waiting.check_health()  # waiting is healthy: Serve must not replace it
    assert waiting.record_routing_stats()["num_running"] == 0
    with pytest.raises(RuntimeError, match="no distilled student yet: run `make distill`"):
        _deltas(waiting, stream=True)

    folder = students_dir(tmp_path) / "student-v1"  # what `tierserve distill` publishes
    folder.mkdir(parents=True)
    (folder / CARD_FILE).write_text("{}")
    deadline = time.monotonic() + 20
    while waiting._engine is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [d.new_text for d in _deltas(waiting, stream=True)] == ["a", "b", "c", "d", "e"]


def test_a_student_is_pinned_to_its_folder_and_reported_with_the_router_beside_it(
    tmp_path, caplog
) -> None:
    config = EngineConfig(model="student", cache_dir=tmp_path)
    with pytest.raises(StudentMissing):
        pin_student(config)
    n = len(FEATURE_NAMES)
    v1 = StudentIdentity("student-v1", "1" * 64)
    router = DifficultyModel(FEATURE_NAMES, (0.0,) * n, 0.0, (0.0,) * n, (1.0,) * n, 0.5, 0.5, v1)
    folder = publish_fake_student(tmp_path, "student-v1", "1" * 64, router)
    pinned, served = pin_student(config)
    assert pinned.model == str(folder)  # a student published later is not what this loads
    assert served == ServedStudent(v1, router)

    publish_fake_student(tmp_path, "student-v2", "2" * 64)
    (students_dir(tmp_path) / "student-v2" / ROUTER_FILE).write_text("{broken")
    with caplog.at_level(logging.WARNING, logger="serving.pools.served_student"):
        _, newest = pin_student(config)
    assert newest == ServedStudent(StudentIdentity("student-v2", "2" * 64))
    assert "ignoring the router beside the student" in caplog.text
    assert pin_student(EngineConfig()) == (EngineConfig(), None)  # the default model
