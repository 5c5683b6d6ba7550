"""Clients streaming through the server, as the serving benchmark runs them: chat bodies
of an exact token count, one streamed request timed from the client's side, a closed
loop of them, and the latency metrics of a loop (named as in BENCHMARKS.md).

A 429 is retried after its Retry-After, as clients do, and counted. TTFT is to the first
content delta, TPOT (last - first token) / (tokens - 1) per request.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import httpx

from bench.prompts import QUESTIONS, passage
from bench.report import emit, percentile
from serving.http.openai_api import ChatEndpoint

BENCH = "serving"
PROMPT_TOKENS = 128
OUTPUT_TOKENS = 64
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


@dataclass(frozen=True)
class Result:
    """One streamed request as the client saw it (times in seconds from its send)."""

    ttft_s: float
    e2e_s: float
    num_output_tokens: int
    num_prompt_tokens: int
    num_rejected: int

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; None with fewer than two tokens."""
        if self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)


class Prompts:
    """Chat bodies whose templated prompt has an exact token count (up to re-tokenizing)."""

    def __init__(self, tokenizer: Any, model: str, seed: int) -> None:
        self._tokenizer = tokenizer
        self._model = model
        self._rng = random.Random(seed)
        self._overhead = len(self._ids(""))

    def body(self, num_tokens: int, max_tokens: int) -> dict[str, Any]:
        """A chat body whose prompt is about `num_tokens` tokens of filler text and a question."""
        question = "\n\n" + self._rng.choice(QUESTIONS)
        budget = num_tokens - self._overhead - len(self._encode(question))
        # Twice the words needed, then cut to the token budget: the question stays whole.
        text_ids = self._encode(passage(2 * num_tokens, self._rng))[: max(1, budget)]
        content = self._tokenizer.decode(text_ids) + question
        return {
            "model": self._model, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
        }  # fmt: skip

    def prompt_ids(self, body: dict[str, Any]) -> list[int]:
        """The token ids the ingress makes of `body`: the same code path, not a copy."""
        (ids,) = ChatEndpoint.prompt_ids(ChatEndpoint.schema.model_validate(body), self._tokenizer)
        return ids

    def _encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)

    def _ids(self, content: str) -> list[int]:
        return self.prompt_ids(
            {"model": self._model, "messages": [{"role": "user", "content": content}]}
        )


async def stream_request(
    http: httpx.AsyncClient, body: dict[str, Any], tier: str, path: str = CHAT_PATH
) -> Result:
    """Send one streaming request, retrying 429s after their Retry-After. `path` is the
    chat or the completions endpoint; the first token is the first non-empty text."""
    for num_rejected in range(100):
        start_s = time.perf_counter()
        first_s: float | None = None
        usage: dict[str, int] = {}
        headers = {"X-SLA-Tier": tier}
        async with http.stream("POST", path, json=body, headers=headers) as r:
            if r.status_code == 429:
                await asyncio.sleep(float(r.headers.get("retry-after", 1)))
                continue
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if first_s is None and any(map(_choice_text, chunk["choices"])):
                    first_s = time.perf_counter()
                usage = chunk.get("usage") or usage
        end_s = time.perf_counter()
        assert first_s is not None, "stream ended without a token"
        return Result(
            first_s - start_s, end_s - start_s, usage["completion_tokens"],
            usage["prompt_tokens"], num_rejected,
        )  # fmt: skip
    raise RuntimeError("rejected 100 times in a row")


def _choice_text(choice: dict[str, Any]) -> str:
    """A streamed choice's new text: a chat delta's content or a completion's text."""
    return choice.get("text") or choice.get("delta", {}).get("content") or ""


async def closed_loop(
    base_url: str,
    tier: str,
    bodies: list[dict[str, Any]],
    concurrency: int,
    path: str = CHAT_PATH,
) -> tuple[list[Result], float]:
    """Every body sent by `concurrency` workers, each starting its next as its last ends."""
    queue = list(reversed(bodies))
    results: list[Result] = []

    async def worker(http: httpx.AsyncClient) -> None:
        """Send queued bodies one after another until the queue is empty."""
        while queue:
            results.append(await stream_request(http, queue.pop(), tier, path))

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as http:
        start_s = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    return results, time.perf_counter() - start_s


def report(
    results: list[Result], wall_s: float, tier: str, concurrency: int, suffix: str = ""
) -> None:
    """The BENCHMARKS.md metrics of one closed-loop run."""
    name = f"{tier}.c{concurrency}{suffix}"
    extra = {
        "n": len(results),
        "prompt_tokens_mean": statistics.mean(r.num_prompt_tokens for r in results),
        "output_tokens": OUTPUT_TOKENS,
        "rejected_429": sum(r.num_rejected for r in results),
    }
    ttft = [r.ttft_s * 1000 for r in results]
    tpot = [r.tpot_s * 1000 for r in results if r.tpot_s is not None]
    e2e = [r.e2e_s * 1000 for r in results]
    for q in (50, 95, 99):
        emit(BENCH, f"ttft_ms.p{q}.{name}", percentile(ttft, q), "ms", **extra)
    for q in (50, 95):
        emit(BENCH, f"tpot_ms.p{q}.{name}", percentile(tpot, q), "ms", **extra)
    for q in (50, 95, 99):
        emit(BENCH, f"e2e_ms.p{q}.{name}", percentile(e2e, q), "ms", **extra)
    emit(BENCH, f"throughput_tok_s.{name}", tok_s(results, wall_s), "tok/s", **extra)


def tok_s(results: list[Result], wall_s: float) -> float:
    """Output tokens per second of wall time over a run's results."""
    return sum(r.num_output_tokens for r in results) / wall_s
