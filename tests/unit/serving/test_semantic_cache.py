"""The semantic cache's parts without Serve: keys, lookup, the race with the generation,
replay, and both stores' bounds (the Redis store against a real redis-server).

Vectors here come from a bag of words (`_bag`), so that similarity is predictable; the
model's own embeddings are exercised through real Serve in
tests/integration/test_serving_semantic_cache.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from policies.tiers import Tier
from serving.cache.config import SemanticCacheConfig
from serving.cache.entries import CacheEntry, StoreBounds
from serving.cache.memory_store import MemoryStore
from serving.cache.redis_store import RedisStore
from serving.cache.replay import replayed_answer, replayed_events, replayed_usage
from serving.cache.request_key import cache_query, cacheable
from serving.cache.semantic_cache import Lookup, SemanticCache
from serving.http.schemas.chat import ChatCompletionRequest
from testing.redis_server import redis_server

STANDARD = Tier(name="standard", ttft_ms=2000, tpot_ms=60, priority=1, pool="p")
INTERACTIVE = Tier(name="interactive", ttft_ms=400, tpot_ms=25, priority=0, pool="p")
BIG = StoreBounds(max_entries=100, max_bytes=10**7, ttl_s=3600)
DIM = 64


def _bag(text: str) -> np.ndarray:
    """Words hashed into DIM buckets, normalized: shared words, similar vectors."""
    vector = np.zeros(DIM, dtype=np.float32)
    for word in text.lower().replace("?", "").split():
        vector[int(hashlib.md5(word.encode()).hexdigest(), 16) % DIM] += 1
    return vector / np.linalg.norm(vector)


def _body(question: str = "What is the capital of France?", **fields: Any) -> ChatCompletionRequest:
    document = {"model": "m", "messages": [{"role": "user", "content": question}],
                "temperature": 0, **fields}  # fmt: skip
    return ChatCompletionRequest.model_validate(document)


def _answer(text: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-x", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13},
    }  # fmt: skip


class _RoundTripStore(MemoryStore):
    """A memory store whose reads wait a round trip, as Redis's do: a generation raced
    against the lookup gets to start meanwhile."""

    async def get(self, entry_id: str) -> CacheEntry | None:
        await asyncio.sleep(0.002)
        return await super().get(entry_id)


class _Cache:
    """A SemanticCache over a memory store, counting the embedding calls."""

    def __init__(
        self, threshold: float = 0.9, bounds: StoreBounds = BIG, store: type = MemoryStore
    ) -> None:
        self.calls = 0
        config = SemanticCacheConfig(enabled=True, threshold=threshold)
        self.store = store(bounds)
        self.cache = SemanticCache(config, "m", self._embed, self.store, CollectorRegistry())

    async def _embed(self, text: str, priority: int, request_id: str) -> np.ndarray:
        self.calls += 1
        await asyncio.sleep(0.005)  # a call to the embedding pool: the generation starts
        return _bag(text)

    async def ask(self, body: ChatCompletionRequest, answer: str | None = None):
        query = self.cache.query(body, STANDARD, {})
        assert query is not None
        lookup = await self.cache.lookup(query, STANDARD, "r")
        if answer is not None and not lookup.hit:
            self.cache.remember(lookup, _answer(answer))
            await asyncio.sleep(0)  # the background store runs
        return lookup


def test_keys_part_every_setting_that_changes_the_answer() -> None:
    base = cache_query(_body(), "e").key
    changed = [
        _body(model="other"),
        _body(temperature=0.7, seed=3),
        _body(max_tokens=5),
        _body(stop=["."]),
        _body(response_format={"type": "json_object"}),
        _body(tools=[{"type": "function", "function": {"name": "f"}}]),
        _body(guided_choice=["a", "b"]),
        ChatCompletionRequest.model_validate({"model": "m", "temperature": 0, "messages": [
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "What is the capital of France?"}]}),
    ]  # fmt: skip
    keys = [cache_query(body, "e").key for body in changed]
    assert base not in keys and len(set(keys)) == len(keys)
    assert cache_query(_body(), "other-embedder").key != base


def test_delivery_fields_do_not_change_the_key_and_case_and_spaces_fold() -> None:
    same = _body("  what IS the capital of   France? ", stream=True, user="u", tier="batch")
    assert cache_query(same, "e") == cache_query(_body(), "e")


def test_only_deterministic_single_answers_are_cacheable() -> None:
    assert cacheable(_body()) is None
    assert cacheable(_body(temperature=0.8, seed=1)) is None
    assert cacheable(_body(temperature=0.8)) is not None
    assert cacheable(_body(n=2)) is not None
    assert cacheable(_body(logprobs=True)) is not None
    assert cacheable(_body(cache=False)) is not None


def test_tier_and_header_opt_out() -> None:
    helper = _Cache()
    assert helper.cache.query(_body(), INTERACTIVE, {}) is None  # off for interactive
    assert helper.cache.query(_body(), STANDARD, {"x-tierserve-cache": "off"}) is None
    assert helper.cache.query(_body(), STANDARD, {}) is not None


def test_a_paraphrase_above_the_threshold_hits_and_below_misses() -> None:
    async def run() -> None:
        helper = _Cache(threshold=0.85)
        assert not (await helper.ask(_body("what is the capital city of france"), "Paris.")).hit
        near = await helper.ask(_body("what is the capital of france"))
        assert near.hit and near.similarity is not None and near.similarity >= 0.85
        assert near.entry is not None and near.entry.answer == _answer("Paris.")
        far = await helper.ask(_body("how many people live in france"))
        assert not far.hit and far.similarity is not None and far.similarity < 0.85
        other_model = await helper.ask(_body("what is the capital city of france", model="o"))
        assert not other_model.hit and other_model.similarity is None  # never across keys

    asyncio.run(run())


def test_an_exact_repeat_skips_the_embedding() -> None:
    async def run() -> None:
        helper = _Cache()
        await helper.ask(_body("Hello there?"), "Hi.")
        assert (await helper.ask(_body("hello   THERE?"))).hit
        assert helper.calls == 1

    asyncio.run(run())


def test_the_memory_store_evicts_least_recently_used_by_count_and_bytes() -> None:
    async def run() -> None:
        store = MemoryStore(StoreBounds(max_entries=2, max_bytes=10**6, ttl_s=60))
        a, b, c = (CacheEntry("k", _bag(t), _answer(t)) for t in ("a", "b", "c"))
        assert await store.put(a) == [] and await store.put(b) == []
        assert await store.get(a.entry_id) is a  # a is now the most recently used
        assert await store.put(c) == [b.entry_id]
        small = MemoryStore(StoreBounds(max_entries=100, max_bytes=2 * a.nbytes + 10, ttl_s=60))
        for entry in (a, b):
            await small.put(entry)
        assert await small.put(c) == [a.entry_id] and small.nbytes <= 2 * a.nbytes + 10

    asyncio.run(run())


def test_entries_expire_after_their_ttl() -> None:
    async def run() -> None:
        helper = _Cache(bounds=StoreBounds(max_entries=10, max_bytes=10**6, ttl_s=0.2))
        await helper.ask(_body("Hello there?"), "Hi.")
        assert (await helper.ask(_body("Hello there?"))).hit
        time.sleep(0.3)
        assert not (await helper.ask(_body("Hello there?"))).hit
        assert len(helper.store) == 0

    asyncio.run(run())


def test_a_hit_cancels_the_generation_and_a_miss_keeps_it() -> None:
    """A new text races its generation; an exact repeat (its embedding remembered) is looked
    up first and starts a generation only on a miss."""

    async def run() -> None:
        helper = _Cache(store=_RoundTripStore)
        started: list[str] = []

        async def generation(name: str) -> AsyncIterator[str]:
            started.append(name)
            await asyncio.sleep(0.01)
            yield "first"
            yield "second"

        def race(question: str, name: str, **fields: Any) -> tuple[Lookup, AsyncIterator[str]]:
            query = helper.cache.query(_body(question, **fields), STANDARD, {})
            assert query is not None
            return Lookup(query, STANDARD), generation(name)

        lookup, miss = race("Hello there?", "miss")
        events = await helper.cache.race(lookup, "r", miss)
        assert not lookup.hit and [e async for e in events] == ["first", "second"]
        helper.cache.remember(lookup, _answer("Hi."))
        await asyncio.sleep(0)
        lookup, reworded = race("there hello?", "reworded")  # the same words, a new text
        events = await helper.cache.race(lookup, "r", reworded)
        assert lookup.hit and [e async for e in events] == []
        assert reworded.ag_frame is None  # closed: nothing more is generated
        lookup, repeat = race("  HELLO there? ", "repeat")  # the first text, normalized
        events = await helper.cache.race(lookup, "r", repeat)
        assert lookup.hit and [e async for e in events] == []
        lookup, repeat_miss = race("Hello there?", "repeat_miss", max_tokens=7)  # another key
        events = await helper.cache.race(lookup, "r", repeat_miss)
        assert not lookup.hit and [e async for e in events] == ["first", "second"]
        assert started == ["miss", "reworded", "repeat_miss"]

    asyncio.run(run())


def test_a_replayed_stream_reassembles_into_the_stored_answer() -> None:
    stored = _answer("Paris is the capital.")
    answer = replayed_answer(stored, "chatcmpl-new", replayed_usage(stored, 20))
    assert answer["id"] == "chatcmpl-new" and answer["usage"]["prompt_tokens"] == 20
    events = list(replayed_events(answer, include_usage=True))
    assert events[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert {c["id"] for c in chunks} == {"chatcmpl-new"}
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "Paris is the capital."
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 24


@pytest.fixture(scope="module")
def redis_url() -> Any:
    with redis_server() as url:
        yield url


def test_two_replicas_share_entries_through_redis(redis_url: str) -> None:
    async def run() -> None:
        bounds = StoreBounds(max_entries=2, max_bytes=10**6, ttl_s=60)
        one, two = (RedisStore(redis_url, "test-share", bounds) for _ in range(2))
        assert await two.added_elsewhere() == []
        a, b, c = (CacheEntry("k", _bag(t), _answer(t)) for t in ("a", "b", "c"))
        await one.put(a)
        [seen] = await two.added_elsewhere()
        assert seen.entry_id == a.entry_id and np.array_equal(seen.vector, a.vector)
        assert seen.answer == a.answer
        await two.put(b)
        assert (await one.get(a.entry_id)) is not None  # a used last: b goes first
        assert await one.put(c) == [b.entry_id]
        assert await two.get(b.entry_id) is None
        assert [e.entry_id for e in await two.added_elsewhere()] == [c.entry_id]
        await one.close()
        await two.close()

    asyncio.run(run())


def test_redis_entries_expire_and_bytes_are_counted_once(redis_url: str) -> None:
    async def run() -> None:
        bounds = StoreBounds(max_entries=10, max_bytes=10**6, ttl_s=0.3)
        one, two = (RedisStore(redis_url, "test-ttl", bounds) for _ in range(2))
        a = CacheEntry("k", _bag("a"), _answer("a"))
        await one.put(a)
        assert await two.get(a.entry_id) is not None
        time.sleep(0.4)
        assert await two.get(a.entry_id) is None and await one.get(a.entry_id) is None
        b = CacheEntry("k", _bag("b"), _answer("b"))
        assert a.entry_id in await one.put(b) or await one.get(a.entry_id) is None
        raw = await one._redis.get("test-ttl:bytes")  # noqa: SLF001 - the books must balance
        assert int(raw) == b.nbytes
        await one.close()
        await two.close()

    asyncio.run(run())
