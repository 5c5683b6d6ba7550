"""Lookup and store: the semantic cache as the ingress uses it.

A request the cache applies to (its tier opted in, not refused by the body's
`"cache": false` or the `x-tierserve-cache: off` header, deterministic: see
serving/cache/request_key.py) is looked up while its generation starts: the last user
turn is embedded by the embedding pool (the same engine path as /v1/embeddings), the
index finds the nearest entry under the request's key, and at or above the threshold
the stored answer is returned and the generation cancelled (`race`). On a miss the
generation was already under way; its first chunk waits for the lookup to end (in
bench_semantic_cache a new question's TTFT rose 107 ms at the median: the embedding
shares the generation's engine and may land a step later), and the answer is stored
when it completes.

Embeddings of texts already seen are kept (`_memo`), so an exact repeat (after
normalization) skips the embedding call and answers in well under a millisecond.

Metrics: `tierserve:semantic_cache_hits` and `_misses` by tier, `_false_hit_checks` by
outcome (a sampled share of hits generated again in the background and compared),
`_lookup_errors` (the embedding failed: the request is served as a miss).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from prometheus_client import CollectorRegistry, Counter

from policies.tiers import Tier
from serving.cache.config import SemanticCacheConfig
from serving.cache.entries import CacheEntry, CacheStore
from serving.cache.index import VectorIndex
from serving.cache.request_key import CacheQuery, cache_query, cacheable
from serving.http.schemas.chat import ChatCompletionRequest
from serving.http.schemas.sampling import SamplingFields

log = logging.getLogger(__name__)

Embed = Callable[[str, int, str], Awaitable[np.ndarray]]
"""(text, priority, request id) -> its unit-length embedding."""
Verify = Callable[[dict[str, Any]], Awaitable[tuple[int, dict[str, Any]]]]
"""Runs a chat body uncached at the batch tier: (status, response body)."""
HEADER = "x-tierserve-cache"
MEMO_SIZE = 8192
"""Texts whose embeddings are kept (576 float32 each: 18 MiB at most)."""
T = TypeVar("T")


@dataclass
class Lookup:
    """What the cache found for one request."""

    query: CacheQuery
    tier: Tier
    vector: np.ndarray | None = None
    """The last turn's embedding (None: embedding failed; the answer will not be stored)."""
    entry: CacheEntry | None = None
    """The stored entry answering this request (a hit), or None."""
    similarity: float | None = None
    """To the nearest entry under the same key, if there is one."""

    @property
    def hit(self) -> bool:
        """Answered from the cache."""
        return self.entry is not None

    @property
    def headers(self) -> dict[str, str]:
        """`x-tierserve-cache: hit|miss`, and the similarity to the nearest entry."""
        headers = {HEADER: "hit" if self.hit else "miss"}
        if self.similarity is not None:
            headers[f"{HEADER}-similarity"] = f"{self.similarity:.4f}"
        return headers


class SemanticCache:
    """The ingress's semantic cache over one store and a local vector index."""

    def __init__(
        self,
        config: SemanticCacheConfig,
        embedding_model: str,
        embed: Embed,
        store: CacheStore,
        registry: CollectorRegistry,
        verify: Verify | None = None,
    ) -> None:
        self.config = config
        self._verify = verify
        """Generates a hit's request again for a false-hit check (None: no checks)."""
        self._embedding_model = embedding_model
        self._embed = embed
        self._store = store
        self._index = VectorIndex()
        self._memo: OrderedDict[str, np.ndarray] = OrderedDict()
        self._background: set[asyncio.Task[Any]] = set()
        self._register(registry)

    def _register(self, registry: CollectorRegistry) -> None:
        name = "tierserve:semantic_cache"
        self._hits = Counter(f"{name}_hits", "Requests answered from the cache.", ["tier"],
                             registry=registry)  # fmt: skip
        self._misses = Counter(f"{name}_misses", "Cache lookups without a hit.", ["tier"],
                               registry=registry)  # fmt: skip
        self._checks = Counter(
            f"{name}_false_hit_checks", "Hits generated again and compared with the stored "
            "answer, by outcome (same text, or different).", ["outcome"], registry=registry,
        )  # fmt: skip
        self._errors = Counter(f"{name}_lookup_errors", "Lookups whose embedding failed.",
                               registry=registry)  # fmt: skip

    def query(
        self, body: SamplingFields, tier: Tier, headers: Mapping[str, str]
    ) -> CacheQuery | None:
        """The request's key and text when the cache applies to it, else None."""
        if not self.config.enabled or tier.name not in self.config.tiers:
            return None
        if headers.get(HEADER, "").lower() == "off" or not isinstance(body, ChatCompletionRequest):
            return None
        if cacheable(body) is not None:
            return None
        return cache_query(body, self._embedding_model)

    async def race(
        self, lookup: Lookup, request_id: str, events: AsyncIterator[T]
    ) -> AsyncIterator[T]:
        """Start the generation (`events`' first item) and the lookup together, filling
        `lookup` in. A hit cancels the generation (nothing comes out); a miss hands back
        the events, the first under way. The caller holds `lookup` before the race, so a
        generation cancelled for a hit already knows it was one.

        Text embedded before (an exact repeat) needs no embedding: its lookup ends before
        a generation would have taken its first step, so none is started for it unless it
        misses (starting one only to cancel it cost a hit more than the lookup itself)."""
        if lookup.query.text in self._memo:
            await self.fill(lookup, request_id)
            first = None
        else:
            first = asyncio.ensure_future(anext(events))
            await self.fill(lookup, request_id)
        if not lookup.hit:
            return events if first is None else _after(first, events)
        if first is not None:
            first.cancel()
            with suppress(asyncio.CancelledError, Exception):
                await first
        await events.aclose()  # type: ignore[attr-defined]  # an async generator's
        return _after(None, events)

    async def lookup(self, query: CacheQuery, tier: Tier, request_id: str) -> Lookup:
        """The nearest entry of the query's key, if near enough (`fill` on a new Lookup)."""
        lookup = Lookup(query, tier)
        await self.fill(lookup, request_id)
        return lookup

    async def fill(self, lookup: Lookup, request_id: str) -> None:
        """Embed the query's text, find the nearest entry of its key, read it if near enough."""
        tier, query = lookup.tier, lookup.query
        try:
            lookup.vector = await self._vector(query.text, tier.priority, request_id)
            await self.sync()
        except Exception:  # noqa: BLE001 - the cache is optional: serve the request as a miss
            log.exception("semantic cache lookup failed for %s", request_id)
            self._errors.inc()
            self._misses.labels(tier.name).inc()
            return
        nearest = self._index.nearest(query.key, lookup.vector)
        if nearest is not None:
            entry_id, lookup.similarity = nearest
            if lookup.similarity >= self.config.threshold:
                lookup.entry = await self._store.get(entry_id)
                if lookup.entry is None:  # evicted or expired (here or by another replica)
                    self._index.remove([entry_id])
        (self._hits if lookup.hit else self._misses).labels(tier.name).inc()

    async def _vector(self, text: str, priority: int, request_id: str) -> np.ndarray:
        vector = self._memo.get(text)
        if vector is None:
            vector = await self._embed(text, priority, request_id)
            self._memo[text] = vector
            if len(self._memo) > MEMO_SIZE:
                self._memo.popitem(last=False)
        self._memo.move_to_end(text)
        return vector

    async def sync(self) -> None:
        """Index the entries other replicas stored since the last look (a shared store)."""
        for entry in await self._store.added_elsewhere():
            self._index.add(entry.key, entry.entry_id, entry.vector)

    def remember(self, lookup: Lookup, answer: dict[str, Any]) -> None:
        """Store a miss's answer in the background (the response does not wait for it)."""
        if lookup.vector is None or lookup.hit:
            return
        entry = CacheEntry(key=lookup.query.key, vector=lookup.vector, answer=answer)
        self._spawn(self._put(entry))

    async def _put(self, entry: CacheEntry) -> None:
        self._index.add(entry.key, entry.entry_id, entry.vector)
        self._index.remove(await self._store.put(entry))

    def check(self, lookup: Lookup, body: SamplingFields) -> None:
        """For a sampled share of hits, generate the answer again in the background and
        count whether it matches the stored one."""
        verify = self._verify
        if verify is None or lookup.entry is None:
            return
        if random.random() >= self.config.check_fraction:
            return
        document = {**body.model_dump(mode="json", exclude_unset=True), "cache": False}
        document.pop("tier", None)
        self._spawn(self._check(lookup.entry, document, verify))

    async def _check(self, entry: CacheEntry, document: dict[str, Any], verify: Verify) -> None:
        status, fresh = await verify({**document, "stream": False})
        if status != 200:
            self._checks.labels("failed").inc()
            return
        stored = entry.answer["choices"][0]["message"].get("content")
        same = fresh["choices"][0]["message"].get("content") == stored
        self._checks.labels("same" if same else "different").inc()

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("semantic cache background work failed", exc_info=task.exception())


async def _after(first: asyncio.Future[T] | None, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    """The item `first` resolves to, then the rest; nothing when `first` is None."""
    if first is None:
        return
    try:
        item = await first
    except StopAsyncIteration:
        return
    yield item
    async for item in rest:
        yield item
