"""Tensor parallelism with real worker ranks (processes joined by gloo): a TP=2 engine gives
TP=1's greedy tokens, through chunked prefill, preemption, the prefix cache and prompt
lookup; a rank that dies stops the engine cleanly; a TP=2 pool serves through Ray Serve."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from openai import OpenAI
from ray.util import placement_group_table

from bench.engine.bench_parallel import allreduce_share, cases
from bench.engine.peer import Case, run_tierserve
from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig, SpecDecodeConfig
from engine.engine import LLMEngine
from engine.engine_loop import EngineRequestError
from engine.parallel.errors import RankLost
from testing.architectures import save_tiny_model
from testing.engine_helpers import TEST_ENGINE_CONFIG, greedy, run_requests
from testing.serve_harness import exact_config, serving

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 64
TIGHT = dict(block_size=4, num_kv_blocks=64, max_num_batched_tokens=24, max_num_seqs=4)
"""A 24-token budget chunks every prompt; 64 blocks of 4 for four ~100-token requests:
some are preempted and recomputed."""
NGRAM = SpecDecodeConfig(method="ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=3)


def prompts(tokenizer) -> list[list[int]]:
    texts = [
        "The capital of France is",
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
        "1, 2, 3, 4, 5, 6, 7, 8,",
        "Once upon a time, in a small village at the edge of a great forest, there lived an "
        "old woman who kept bees, and every morning she walked to the hives",
    ]
    return [tokenizer.encode(text) for text in texts]


def greedy_runs(engine: LLMEngine, token_lists: list[list[int]]) -> dict:
    params = greedy(MAX_TOKENS, logprobs=1, ignore_eos=True)
    requests = {f"p{i}": (tokens, params) for i, tokens in enumerate(token_lists)}
    first = run_requests(engine, requests)
    again = run_requests(engine, {"again": (token_lists[-1], params)})  # from the prefix cache
    return {**first, **again}


def assert_same_runs(ours: dict, reference: dict) -> None:
    for request_id, expected in reference.items():
        assert ours[request_id].token_ids == expected.token_ids, request_id
        for mine, theirs in zip(ours[request_id].logprobs, expected.logprobs, strict=True):
            assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)


@pytest.mark.parametrize("model", ["default", "qwen2", "gemma3"])
def test_tp2_greedy_equals_tp1_token_for_token(model, tokenizer, tmp_path):
    """The default model splits its 3 KV heads 2 + 1; Qwen2 adds biases, Gemma 3 sandwich
    norms, q/k norms and tied embeddings."""
    name = model if model == "default" else str(save_tiny_model(model, tmp_path))
    config = dict(TEST_ENGINE_CONFIG, model=name, dtype="float32", **TIGHT, spec_decode=NGRAM)
    token_lists = prompts(tokenizer)
    reference = greedy_runs(LLMEngine(EngineConfig(**config)), token_lists)
    engine = LLMEngine(EngineConfig(**config, tensor_parallel_size=2))
    try:
        ours = greedy_runs(engine, token_lists)
        stats = engine.stats()
    finally:
        engine.close()
    assert_same_runs(ours, reference)
    assert stats.num_preemptions > 0 and stats.spec_num_draft_tokens > 0
    assert ours["again"].num_cached_tokens > 0


def test_a_killed_rank_ends_the_streams_and_the_engine(tokenizer):
    engine = AsyncLLMEngine(EngineConfig(**TEST_ENGINE_CONFIG, tensor_parallel_size=2))
    core = engine.core.loop.engine
    prompt = tokenizer.encode("The capital of France is")

    async def first_token() -> list[int]:
        async for out in engine.generate(prompt, greedy(4, ignore_eos=True), "before"):
            return out.new_token_ids
        return []

    assert asyncio.run(asyncio.wait_for(first_token(), timeout=60))
    worker = core.ranks._workers[0].process
    worker.kill()
    worker.wait()

    async def after() -> None:
        async for _ in engine.generate(prompt, greedy(4, ignore_eos=True), "after"):
            pass

    with pytest.raises(EngineRequestError, match=RankLost.__name__):
        asyncio.run(asyncio.wait_for(after(), timeout=60))
    assert not engine.is_alive()


def test_a_tp2_pool_answers_the_openai_client_through_serve_from_one_placement_group():
    """The interactive pool at tensor_parallel_size 2: its replica and its second rank in one
    STRICT_PACK placement group; its greedy answer is the offline pool's (TP=1, both exact)."""
    base = exact_config()
    pools = tuple(
        pool.model_copy(
            update={"engine": replace(pool.engine, tensor_parallel_size=2), "num_cpus": 0.25}
        )  # fmt: skip
        if pool.name == "interactive"
        else pool
        for pool in base.pools
    )
    with serving(base.with_changes(pools=pools)) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused")
        answers = {}
        for tier in ("interactive", "batch"):
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": "Name three colours."}],
                max_tokens=16, temperature=0, extra_headers={"X-SLA-Tier": tier},
            )  # fmt: skip
            answers[raw.headers["x-tierserve-pool"]] = raw.parse().choices[0].message.content
        groups = [g for g in placement_group_table().values() if g["state"] == "CREATED"]
    assert answers["interactive"] and answers["interactive"] == answers["offline"]
    assert [(g["strategy"], len(g["bundles"])) for g in groups] == [("STRICT_PACK", 2)]


def test_bench_parallel_measures_a_tp2_engine_and_its_sums():
    engine = LLMEngine(EngineConfig(**TEST_ENGINE_CONFIG, tensor_parallel_size=2))
    try:
        case = Case("tiny", cases(quick=True)[0].prompts[:4], max_tokens=4, batch=4)
        assert run_tierserve(engine, case).tok_s > 0
        assert 0 < allreduce_share(engine, case) < 1
    finally:
        engine.close()
