"""Fault isolation: one bad request, a failing step or a wedged step never takes the engine down."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine import sampler
from engine.async_engine import AsyncLLMEngine, EngineRequestError
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from testing.engine_helpers import TEST_ENGINE_CONFIG, assert_all_blocks_free, drain, greedy

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]


def test_tiny_temperature_is_greedy_not_an_overflow(engine):
    tiny = SamplingParams(max_tokens=6, temperature=1e-300, ignore_eos=True)
    engine.add_request("tiny", PROMPT, tiny)
    engine.add_request("greedy", PROMPT, greedy(6, ignore_eos=True))
    done = drain(engine)
    assert done["tiny"].token_ids == done["greedy"].token_ids
    assert done["tiny"].finish_reason == "length"


def test_a_request_whose_sampling_raises_fails_alone(engine, monkeypatch):
    def explode(*args, **kwargs):
        raise RuntimeError("poisoned logits")

    monkeypatch.setattr(sampler, "apply_repetition_penalty", explode)
    engine.add_request("bad", PROMPT, greedy(8, repetition_penalty=1.3))
    engine.add_request("good-1", PROMPT, greedy(8, ignore_eos=True))
    engine.add_request("good-2", PROMPT[::-1], greedy(8, ignore_eos=True))
    done = drain(engine)  # also checks that every KV block came back
    assert done["bad"].finish_reason == "error"
    assert done["bad"].token_ids == []
    assert [done[r].finish_reason for r in ("good-1", "good-2")] == ["length", "length"]
    assert [len(done[r].token_ids) for r in ("good-1", "good-2")] == [8, 8]


def test_a_failing_forward_pass_fails_its_step_and_the_engine_goes_on(engine, monkeypatch):
    forward = engine.runner.forward
    calls = {"n": 0}

    def fail_second_step(batch):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("kernel fault")
        return forward(batch)

    monkeypatch.setattr(engine.runner, "forward", fail_second_step)
    engine.add_request("early", PROMPT, greedy(8, ignore_eos=True))
    first = engine.step()
    assert [o.new_token_ids != [] for o in first] == [True]
    failed = engine.step()
    assert [(o.request_id, o.finish_reason) for o in failed] == [("early", "error")]
    assert "kernel fault" in (failed[0].error or "")
    assert_all_blocks_free(engine.kv)
    engine.add_request("later", PROMPT, greedy(8, ignore_eos=True))
    done = drain(engine)
    assert done["later"].finish_reason == "length" and len(done["later"].token_ids) == 8


def test_async_engine_raises_for_the_failed_request_and_serves_the_next(monkeypatch):
    engine = AsyncLLMEngine(EngineConfig(**TEST_ENGINE_CONFIG))
    original = engine.core.loop.engine.runner.forward
    fail_once = {"armed": True}

    def flaky(batch):
        if fail_once.pop("armed", False):
            raise RuntimeError("transient")
        return original(batch)

    monkeypatch.setattr(engine.core.loop.engine.runner, "forward", flaky)

    async def run(request_id: str) -> list[int]:
        tokens: list[int] = []
        async for out in engine.generate(PROMPT, greedy(4, ignore_eos=True), request_id):
            tokens += out.new_token_ids
        return tokens

    with pytest.raises(EngineRequestError, match="transient"):
        asyncio.run(asyncio.wait_for(run("first"), timeout=30))
    assert len(asyncio.run(asyncio.wait_for(run("second"), timeout=30))) == 4
    assert engine.is_alive()
    assert engine.stats().kv_cache_usage == 0.0


def test_a_wedged_step_makes_the_engine_unhealthy_until_it_returns(monkeypatch):
    engine = AsyncLLMEngine(EngineConfig(**TEST_ENGINE_CONFIG, stall_timeout_s=0.3))
    original = engine.core.loop.engine.runner.forward
    release = threading.Event()

    def wedge(batch):
        release.wait(timeout=30)
        return original(batch)

    monkeypatch.setattr(engine.core.loop.engine.runner, "forward", wedge)

    async def scenario() -> bool:
        stream = engine.generate(PROMPT, greedy(2, ignore_eos=True), "wedged")
        consumer = asyncio.ensure_future(anext(stream))
        deadline = time.monotonic() + 10
        while engine.is_alive():
            assert time.monotonic() < deadline, "a wedged step never showed in health"
            await asyncio.sleep(0.05)
        release.set()
        await asyncio.wait_for(consumer, timeout=30)
        async for _ in stream:
            pass
        return engine.is_alive()

    assert asyncio.run(scenario()), "health should recover once the step returns"
