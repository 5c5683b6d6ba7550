"""The semantic cache: how often it answers, how often wrongly, what a hit saves and what
a miss costs, in one run.

  python -m bench.serving.bench_semantic_cache [--quick] [--config configs/local.yaml]

Through the real app (configs/local.yaml's pools without the small one, the cache on
with its configured threshold, memory backend, on a private Ray cluster), over the
held-out split of data/semantic_cache/pairs.jsonl:

- each pair's first question is asked (streamed, greedy, 8 tokens): a miss, stored;
  then its second question: `semantic_cache.hit_rate` is the share of paraphrases
  answered from the cache, `semantic_cache.false_hit_rate` the share of near misses;
- `ratio.ttft.cache_hit_vs_miss`: median time to the first content of the hits over
  that of the first questions' misses (both through the same ingress and stream), every
  hit counted; then `..._paraphrase_hit_vs_miss` (second questions that hit: they are
  embedded) and `..._repeat_hit_vs_miss` (each first question asked again in other
  case, the same text once normalized: the embedding memo answers, no embedding call);
- `ratio.ttft.refusal_floor_vs_miss`: a hit's floor, the whole answer of a request the
  ingress refuses once it has read and parsed its body (an unknown model's 404), over a
  miss's TTFT: Serve's proxy hop and the replica's fetch of the body cost every POST this;
- `semantic_cache.miss_overhead_ms.p95`: what the cache's own work adds to a miss, in
  the ingress's process: key and text, the lookup in an index of the configured size
  (`max_entries` entries spread over keys), the store's bookkeeping, and the stored
  answer built, with the embedding excluded: it runs beside the generation's first step
  (serving/cache/semantic_cache.py `race`), and `ttft_delta` below measures that;
- `semantic_cache.miss_ttft_delta_ms.p50`: a fresh question's TTFT with the cache on
  minus the same question's with `"cache": false`, paired (negative: noise won);
- `semantic_cache.embedding.<way>.held_out_auc`: how well each way of embedding a
  question separates paraphrases from near misses on the held-out split (1.0 perfect,
  0.5 chance), with the threshold it calibrates to and its held-out hit and false-hit
  rates: `question_last` (the cache's: framed as a question, last position),
  `plain_mean` (/v1/embeddings' mean pooling of the text) and `plain_last` (in-process
  engine of the embedding pool's settings, as `tierserve cache calibrate` runs it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
from prometheus_client import CollectorRegistry

from bench.report import emit, log, percentile
from serving.app_config import TierserveConfig, load_config
from serving.cache.calibration import (
    Pair,
    choose_threshold,
    load_pairs,
    rates,
    separation_auc,
    similarities,
)
from serving.cache.entries import CacheEntry, StoreBounds
from serving.cache.memory_store import MemoryStore
from serving.cache.semantic_cache import HEADER, SemanticCache
from serving.http.schemas.chat import ChatCompletionRequest
from testing.local_cluster import serving

BENCH = "semantic_cache"
DEFAULT_CONFIG = Path("configs/local.yaml")
MAX_TOKENS = 8


@dataclass(frozen=True)
class Settings:
    """The sizes of one run."""

    num_pairs: int | None
    """Held-out pairs of each kind asked (None: all)."""
    num_overhead_lookups: int
    num_fresh_questions: int
    """Questions asked with and without the cache for the TTFT delta."""


FULL = Settings(num_pairs=None, num_overhead_lookups=2000, num_fresh_questions=20)
QUICK = Settings(num_pairs=10, num_overhead_lookups=300, num_fresh_questions=6)


def bench_config(path: Path) -> TierserveConfig:
    """The config file's app with the cache on (memory backend) and no small pool."""
    base = load_config(path)
    cache = base.semantic_cache.model_copy(update={"enabled": True, "backend": "memory"})
    small = base.small_model.pool if base.small_model else None
    pools = tuple(p for p in base.pools if p.name != small)
    return base.with_changes(pools=pools, small_model=None, semantic_cache=cache)


def held_out(pairs: list[Pair], settings: Settings) -> dict[str, list[Pair]]:
    """The held-out pairs of each kind, cut to the run's size."""
    return {
        kind: [p for p in pairs if p.kind == kind and p.split == "held_out"][: settings.num_pairs]
        for kind in ("paraphrase", "near_miss")
    }


async def _ask(client: httpx.AsyncClient, question: str, cache: bool = True) -> tuple[str, float]:
    """A streamed greedy chat request: (its cache header, seconds to its first content)."""
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": question}],
            "temperature": 0, "max_tokens": MAX_TOKENS, "stream": True, "cache": cache}  # fmt: skip
    start_s = time.perf_counter()
    ttft_s: float | None = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():  # read to the end: the request completes
            if ttft_s is None and line.startswith("data: {") and _content(line):
                ttft_s = time.perf_counter() - start_s
    if ttft_s is None:
        ttft_s = time.perf_counter() - start_s
    return response.headers.get(HEADER, "off"), ttft_s


def _content(line: str) -> str | None:
    """The content a chunk's first choice adds (None for a chunk without choices)."""
    choices = json.loads(line.removeprefix("data: "))["choices"]
    return choices[0]["delta"].get("content") if choices else None


async def _through_serve(base_url: str, pairs: dict[str, list[Pair]], settings: Settings) -> dict:
    """Hit and false-hit rates, the TTFT of hits and misses, the miss's TTFT delta."""
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        await _ask(client, "Warm up: say hello.", cache=False)
        miss_ttft, hit_ttft, hits = [], [], {kind: 0 for kind in pairs}
        for first in dict.fromkeys(p.a for kind_pairs in pairs.values() for p in kind_pairs):
            header, ttft_s = await _ask(client, first)
            if header == "miss":
                miss_ttft.append(ttft_s)
        for kind, kind_pairs in pairs.items():
            for pair in kind_pairs:
                header, ttft_s = await _ask(client, pair.b)
                if header == "hit":
                    hits[kind] += 1
                    hit_ttft.append(ttft_s)
        repeat_ttft, refused_s = [], []
        for first in dict.fromkeys(p.a for kind_pairs in pairs.values() for p in kind_pairs):
            header, ttft_s = await _ask(client, first.upper())  # the same text once normalized
            if header == "hit":
                repeat_ttft.append(ttft_s)
            refused_s.append(await _refused(client, first))
        deltas = []
        for i in range(settings.num_fresh_questions):
            question = f"In one word, what colour is fresh fruit number {i}?"
            _, off_s = await _ask(client, question, cache=False)
            _, on_s = await _ask(client, question)
            deltas.append((on_s - off_s) * 1000)
    return {"miss_ttft": miss_ttft, "hit_ttft": hit_ttft, "hits": hits, "deltas": deltas,
            "repeat_ttft": repeat_ttft, "refused_s": refused_s}  # fmt: skip


async def _refused(client: httpx.AsyncClient, question: str) -> float:
    """Seconds to the whole answer of a chat request the ingress refuses once it has read
    and parsed the body (a model that does not exist): the least a POST costs through the
    proxy here, a hit's floor."""
    body = {"model": "no-such-model", "messages": [{"role": "user", "content": question}],
            "stream": True}  # fmt: skip
    start_s = time.perf_counter()
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 404, response.text
    return time.perf_counter() - start_s


def miss_overhead_ms(config: TierserveConfig, num_lookups: int) -> list[float]:
    """The cache's own milliseconds on a miss (embedding excluded: a precomputed vector),
    with the index as full as `max_entries` allows, over 64 keys."""
    settings = config.semantic_cache
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((num_lookups + settings.max_entries, 576)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    answer = {"choices": [{"message": {"content": "x" * 200}}]}
    bounds = StoreBounds(settings.max_entries, settings.max_bytes, settings.ttl_s)
    store = MemoryStore(bounds)

    async def embed(text: str, priority: int, request_id: str) -> np.ndarray:
        return vectors[int(text.rsplit(" ", 1)[1]) % len(vectors)]

    cache = SemanticCache(settings, "m", embed, store, CollectorRegistry())
    tier = config.tier("standard")

    async def run() -> list[float]:
        for i in range(settings.max_entries):
            body = _body(f"question {i}", i % 64)
            query = cache.query(body, tier, {})
            assert query is not None
            cache._index.add(query.key, f"seed-{i}", vectors[i])  # noqa: SLF001 - pre-filled
            await store.put(CacheEntry(query.key, vectors[i], answer, entry_id=f"seed-{i}"))
        times = []
        for i in range(settings.max_entries, settings.max_entries + num_lookups):
            cache._memo.clear()  # noqa: SLF001 - every lookup a fresh text
            start_s = time.perf_counter()
            body = _body(f"question {i}", i % 64)
            query = cache.query(body, tier, {})
            assert query is not None
            lookup = await cache.lookup(query, tier, "bench")
            cache.remember(lookup, answer)
            await asyncio.sleep(0)  # the store's bookkeeping runs
            times.append((time.perf_counter() - start_s) * 1000)
        return times

    return asyncio.run(run())


def _body(question: str, variant: int) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "temperature": 0,
            "max_tokens": 16 + variant,
            "messages": [{"role": "user", "content": question}],
        }  # fmt: skip
    )


EMBEDDINGS = {"question_last": (True, "last"), "plain_mean": (False, "mean"),
              "plain_last": (False, "last")}  # fmt: skip
"""The ways of embedding a question compared: (framed as a question, pooling)."""


def embedding_comparison(config: TierserveConfig, pairs: list[Pair]) -> dict[str, dict]:
    """Each way's threshold (calibration split, the configured false-hit budget) and
    what it gives on the held-out split, with its separation (AUC, held out)."""
    from cli.cache import calibration_engine, embed_texts

    engine = calibration_engine(config)
    texts = [t for p in pairs for t in (p.a, p.b)]
    compared = {}
    for way, (framed, pooling) in EMBEDDINGS.items():
        vectors = embed_texts(engine, texts, framed, pooling)
        split = {
            s: [similarities(pairs, vectors, k, s) for k in ("paraphrase", "near_miss")]
            for s in ("calibration", "held_out")
        }
        threshold = choose_threshold(*split["calibration"])
        point = rates(*split["held_out"], threshold)
        compared[way] = {
            "auc": separation_auc(*split["held_out"]),
            "threshold": threshold,
            "hit_rate": point.hit_rate,
            "false_hit_rate": point.false_hit_rate,
        }
    return compared


def main() -> None:
    """Run the benchmark and print its JSON lines."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a subset of the pairs")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    args = parser.parse_args()
    settings = QUICK if args.quick else FULL
    config = bench_config(args.config)
    pairs = load_pairs()
    threshold = config.semantic_cache.threshold
    for way, figures in embedding_comparison(config, pairs).items():
        auc = figures.pop("auc")
        emit(BENCH, f"semantic_cache.embedding.{way}.held_out_auc", auc, "auc", **figures)
    overhead = miss_overhead_ms(config, settings.num_overhead_lookups)
    emit(BENCH, "semantic_cache.miss_overhead_ms.p95", percentile(overhead, 95), "ms",
         entries=config.semantic_cache.max_entries, target="<= 5")  # fmt: skip
    chosen = held_out(pairs, settings)
    num_pairs = sum(len(v) for v in chosen.values())
    log(f"through Serve: {num_pairs} held-out pairs, threshold {threshold}")
    with serving(config) as base_url:
        measured = asyncio.run(_through_serve(base_url, chosen, settings))
    for kind, metric, target in (
        ("paraphrase", "hit_rate", ">= 0.5"),
        ("near_miss", "false_hit_rate", "<= 0.01"),
    ):
        n = len(chosen[kind])
        emit(BENCH, f"semantic_cache.{metric}", measured["hits"][kind] / n, "ratio", n=n,
             threshold=threshold, target=target)  # fmt: skip
    _emit_ttft(measured)


def _emit_ttft(measured: dict) -> None:
    """TTFT of hits over misses: every hit (paraphrases and repeats), then each kind."""
    miss_ttft = measured["miss_ttft"]
    kinds = {
        "ratio.ttft.cache_hit_vs_miss": measured["hit_ttft"] + measured["repeat_ttft"],
        "ratio.ttft.cache_paraphrase_hit_vs_miss": measured["hit_ttft"],
        "ratio.ttft.cache_repeat_hit_vs_miss": measured["repeat_ttft"],
    }
    for metric, hit_ttft in kinds.items():
        if hit_ttft and miss_ttft:
            hit_s, miss_s = statistics.median(hit_ttft), statistics.median(miss_ttft)
            emit(BENCH, metric, hit_s / miss_s, "ratio", hits=len(hit_ttft),
                 misses=len(miss_ttft), hit_ms=1000 * hit_s, miss_ms=1000 * miss_s,
                 target="<= 0.1")  # fmt: skip
    if miss_ttft:
        refused = measured["refused_s"]
        floor_s, miss_s = statistics.median(refused), statistics.median(miss_ttft)
        emit(BENCH, "ratio.ttft.refusal_floor_vs_miss", floor_s / miss_s, "ratio",
             n=len(refused), floor_ms=1000 * floor_s, miss_ms=1000 * miss_s)  # fmt: skip
    emit(BENCH, "semantic_cache.miss_ttft_delta_ms.p50", statistics.median(measured["deltas"]),
         "ms", n=len(measured["deltas"]))  # fmt: skip


if __name__ == "__main__":
    main()
