"""The engine's API: bad input, abort, the asyncio front, live stats."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.model.chat import chat_prompt_ids
from engine.outputs import EngineStats
from engine.sampling_params import SamplingParams
from testing.engine_helpers import (
    TEST_ENGINE_CONFIG,
    Completion,
    assert_books_balance,
    drain,
    greedy,
    run_one,
)

LONG = greedy(64, ignore_eos=True)
"""Runs long enough that only an abort can end it within the tests' waits."""


@pytest.fixture(scope="module", params=[False, True], ids=["thread", "process"])
def async_engine(request) -> AsyncLLMEngine:
    """The front over each core: the loop in a thread, and in a child process."""
    return AsyncLLMEngine(EngineConfig(**TEST_ENGINE_CONFIG, separate_process=request.param))


def allocation_state(engine: LLMEngine) -> tuple:
    """Everything a request leaves behind once the engine has accepted it."""
    scheduler, kv = engine.scheduler, engine.kv
    return (
        sorted(engine.requests),
        len(scheduler.waiting),
        len(scheduler.running),
        kv.pool.num_free_blocks,
        kv.num_queries,
        engine.counters.num_prompt_tokens,
    )


# ---- bad input -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(max_tokens=0), r"max_tokens must be >= 1, got 0"),
        (dict(temperature=-0.1), r"temperature must be >= 0, got -0.1"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
        (dict(top_k=-2), r"top_k must be >= -1"),
        (dict(temperature=float("nan")), r"temperature must be a finite number"),
        (dict(top_p=float("inf")), r"top_p must be a finite number"),
        (dict(repetition_penalty=float("nan")), r"repetition_penalty must be a finite number"),
        (dict(repetition_penalty=0.0), r"repetition_penalty must be > 0"),
        (dict(seed=2**64), r"seed must be a 64-bit integer"),
    ],
)
def test_bad_sampling_params_name_the_field_and_limit(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def bad_prompts(max_model_len: int) -> dict[str, tuple[list[int], SamplingParams, str]]:
    return {
        "empty": ([], greedy(4), r"prompt must not be empty"),
        "longer than the context": (
            [1] * max_model_len,
            greedy(4),
            rf"{max_model_len} tokens.*max_model_len is {max_model_len}",
        ),
        "prompt + max_tokens over the context": (
            [1] * (max_model_len - 4),
            greedy(8),
            rf"max_tokens \(8\) = {max_model_len + 4} exceeds max_model_len \({max_model_len}\)",
        ),
        "over the KV pool": ([1] * 1000, greedy(100), r"exceeds the KV cache capacity of 1024"),
        "token outside the vocabulary": (
            [49152],
            greedy(4),
            r"prompt_token_ids must be in \[0, 49152\)",
        ),
    }


@pytest.mark.parametrize("case", list(bad_prompts(8192)))
def test_bad_prompt_is_refused_before_anything_is_allocated(engine, case):
    assert engine.max_model_len == 8192
    prompt, params, message = bad_prompts(engine.max_model_len)[case]
    before = allocation_state(engine)
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, params)
    assert allocation_state(engine) == before


def test_duplicate_request_id_is_refused(engine):
    engine.add_request("twice", [1, 2, 3], greedy(2))
    before = allocation_state(engine)
    with pytest.raises(ValueError, match="already running"):
        engine.add_request("twice", [4, 5, 6], greedy(2))
    assert allocation_state(engine) == before
    drain(engine)


# ---- abort ---------------------------------------------------------------------


def test_abort_frees_the_blocks_and_the_rest_carry_on(engine, tokenizer):
    engine.add_request("keep", chat_prompt_ids(tokenizer, "Name a colour."), greedy(6))
    engine.add_request("drop", chat_prompt_ids(tokenizer, "Count to fifty."), LONG)
    engine.step()
    engine.step()
    dropped = engine.requests["drop"].request
    assert dropped.block_ids
    usage = engine.kv.usage

    out = engine.abort_request("drop")

    assert (out.finished, out.finish_reason, out.new_token_ids) == (True, "abort", [])
    assert dropped.block_ids == [] and engine.kv.usage < usage
    assert_books_balance(engine.kv, [engine.requests["keep"].request])
    assert engine.abort_request("drop") is None
    completions = drain(engine)
    assert set(completions) == {"keep"}
    assert completions["keep"].finish_reason in ("stop", "length")


def test_abort_of_a_waiting_request_dequeues_it(engine):
    engine.add_request("queued", [1, 2, 3], greedy(2))
    assert engine.abort_request("queued").finish_reason == "abort"
    assert not engine.has_unfinished()
    assert engine.step() == []


# ---- stats ---------------------------------------------------------------------


def test_stats_track_queue_usage_and_throughput(engine):
    before = engine.stats()
    prompts = {f"s{i}": [10 + i] * (3 + i) for i in range(engine.config.max_num_seqs + 1)}
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, greedy(4, ignore_eos=True))
    queued = engine.stats()
    assert (queued.num_running, queued.num_waiting, queued.kv_cache_usage) == (0, 9, 0.0)

    engine.step()
    busy = engine.stats()
    assert (busy.num_running, busy.num_waiting) == (8, 1)
    assert busy.kv_cache_usage == 8 / engine.kv.pool.num_blocks  # one block each
    drain(engine)

    after = engine.stats()
    assert (after.num_running, after.num_waiting, after.kv_cache_usage) == (0, 0, 0.0)
    num_prompt = sum(len(p) for p in prompts.values())
    assert after.num_prompt_tokens - before.num_prompt_tokens == num_prompt
    assert after.num_generation_tokens - before.num_generation_tokens == 4 * len(prompts)
    assert after.prefix_cache_queries - before.prefix_cache_queries >= num_prompt
    assert after.generation_tokens_per_s > 0
    assert 0.0 <= after.prefix_cache_hit_rate <= 1.0


# ---- the asyncio front ---------------------------------------------------------


async def collect(stream) -> Completion:
    completion = Completion()
    async for out in stream:
        completion.add(out)
    return completion


async def wait_until_idle(async_engine: AsyncLLMEngine, timeout_s: float = 20.0) -> EngineStats:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = async_engine.stats()
        if stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0:
            return stats
        assert time.monotonic() < deadline, f"engine still busy: {stats}"
        await asyncio.sleep(0.01)


def test_async_generate_streams_what_the_sync_engine_produces(async_engine, engine, tokenizer):
    prompt = chat_prompt_ids(tokenizer, "What is the capital of France?")
    streamed = asyncio.run(collect(async_engine.generate(prompt, greedy(8), "stream")))
    direct = run_one(engine, prompt, greedy(8))
    assert (streamed.token_ids, streamed.text) == (direct.token_ids, direct.text)
    assert streamed.finish_reason in ("stop", "length") and "Paris" in streamed.text


def test_the_first_output_carries_the_instants_of_its_hops_in_order(async_engine, tokenizer):
    async def outputs() -> list:
        prompt = chat_prompt_ids(tokenizer, "Name a colour.")
        return [o async for o in async_engine.generate(prompt, greedy(3), "timed")]

    before = time.time()
    first, *rest = asyncio.run(outputs())
    times = first.first_token_times
    assert times is not None and all(o.first_token_times is None for o in rest)
    instants = [times.sent_s, times.arrived_s, times.scheduled_s, times.first_token_s]
    assert before <= instants[0] and instants == sorted(instants)
    assert times.first_token_s <= times.received_s <= time.time()


def test_async_generate_refuses_bad_input_and_stays_alive(async_engine):
    with pytest.raises(ValueError, match="prompt must not be empty"):
        asyncio.run(collect(async_engine.generate([], greedy(4), "empty")))
    assert async_engine.is_alive()


def test_async_abort_ends_the_stream_and_frees_blocks(async_engine, tokenizer):
    prompt = chat_prompt_ids(tokenizer, "Count to fifty.")

    async def scenario() -> tuple[Completion, EngineStats]:
        stream = async_engine.generate(prompt, LONG, "to-abort")
        completion = Completion()
        completion.add(await anext(stream))
        async_engine.abort("to-abort")
        async for out in stream:
            completion.add(out)
        return completion, await wait_until_idle(async_engine)

    completion, stats = asyncio.run(asyncio.wait_for(scenario(), timeout=10))
    assert completion.finish_reason == "abort"
    assert len(completion.token_ids) < LONG.max_tokens
    assert stats.kv_cache_usage == 0.0


def test_consumer_that_stops_iterating_frees_blocks(async_engine, tokenizer):
    prompt = chat_prompt_ids(tokenizer, "Count to fifty.")

    async def walk_away() -> EngineStats:
        async for _ in async_engine.generate(prompt, LONG, "walk-away"):
            break  # e.g. the HTTP client disconnected
        return await wait_until_idle(async_engine)

    before = async_engine.stats().num_generation_tokens
    stats = asyncio.run(walk_away())
    assert stats.num_generation_tokens - before < LONG.max_tokens  # aborted, not finished
    assert async_engine.is_alive()
