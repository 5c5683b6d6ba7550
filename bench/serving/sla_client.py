"""The SLA benchmark's client: streamed chat requests tagged with a tier, timed as the
client sees them, and the windows a phase's throughput is read over.

Kept apart from the benchmark's phases (bench_sla.py) and its report (sla_report.py): both
read what this records.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.prompts import chat_turn
from bench.serving import cpu_shares
from policies.tiers import Tier

TIERS = ("interactive", "standard", "batch")
PROMPT_TOKENS = 128
OUTPUT_TOKENS = 64
MAX_RETRY_WAIT_S = 5.0
"""The longest a refused stream waits before its next request, whatever Retry-After says."""


@dataclass
class Outcome:
    """One request as the client saw it."""

    tier: str
    status: int
    start_s: float
    ttft_s: float | None = None
    tpot_s: float | None = None
    predicted_ttft_ms: float | None = None
    predicted_tpot_ms: float | None = None
    pool: str | None = None
    batch_running_at_refusal: int = 0
    retry_after_s: float | None = None
    num_tokens: int = 0
    first_token_s: float | None = None
    """perf_counter time of the first and last content deltas."""
    last_token_s: float | None = None
    request_id: str | None = None
    server_ttft_ms: float | None = None
    """From the ingress's log line: arrival at the ingress to its first token there."""
    ttft_hops_ms: dict[str, float] | None = None
    """From the ingress's log line: its first token, hop by hop (handle, engine inbox,
    engine queue, steps, the ways back)."""
    refusal_reason: str | None = None
    """From the ingress's log line of a refused request: why (e.g. `shed_slo`), with the
    prediction placement refused it on in `predicted_ttft_ms`."""
    refusal_predictions_ms: dict[str, list[float]] | None = None
    """From the same line: each candidate pool's predicted [TTFT, TPOT, sequences ahead]
    (why none was chosen)."""

    def tokens_within(self, start_s: float, end_s: float) -> float:
        """Output tokens streamed between the two times, taken as evenly spread between the
        first and last token (a phase's throughput, without the drain after it)."""
        first, last = self.first_token_s, self.last_token_s
        if first is None or last is None or self.num_tokens == 0:
            return 0.0
        if last <= first:
            return float(self.num_tokens) if start_s <= first <= end_s else 0.0
        overlap = max(0.0, min(last, end_s) - max(first, start_s))
        return self.num_tokens * overlap / (last - first)


@dataclass
class Client:
    """Sends chat requests and remembers what each tier got."""

    http: httpx.AsyncClient
    tiers: dict[str, Tier]
    model: str
    outcomes: list[Outcome] = field(default_factory=list)
    batch_running: int = 0
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    async def chat(self, tier: str) -> Outcome:
        """One streamed chat; records its outcome (a 429 included) and returns it."""
        body = {
            "model": self.model, "max_tokens": OUTPUT_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": chat_turn(PROMPT_TOKENS, self.rng)}],
        }  # fmt: skip
        outcome = Outcome(tier, 0, time.perf_counter())
        self.batch_running += tier == "batch"
        try:
            await self._stream(body, outcome)
        finally:
            self.batch_running -= tier == "batch"
        self.outcomes.append(outcome)
        return outcome

    async def _stream(self, body: dict[str, Any], outcome: Outcome) -> None:
        headers = {"X-SLA-Tier": outcome.tier}
        async with self.http.stream(
            "POST", "/v1/chat/completions", json=body, headers=headers
        ) as r:
            outcome.status = r.status_code
            outcome.request_id = r.headers.get("x-tierserve-request-id")
            if r.status_code != 200:
                outcome.batch_running_at_refusal = self.batch_running
                outcome.retry_after_s = _header_float(r.headers, "retry-after")
                await r.aread()
                return
            outcome.pool = r.headers.get("x-tierserve-pool")
            outcome.predicted_ttft_ms = _header_float(r.headers, "x-tierserve-predicted-ttft-ms")
            outcome.predicted_tpot_ms = _header_float(r.headers, "x-tierserve-predicted-tpot-ms")
            await _read_stream(r, outcome)

    def met_slo(self, outcome: Outcome) -> bool:
        """Admitted and within both of its tier's targets."""
        tier = self.tiers[outcome.tier]
        return (
            outcome.status == 200
            and outcome.ttft_s is not None
            and outcome.ttft_s * 1000 <= tier.ttft_ms
            and (outcome.tpot_s is None or outcome.tpot_s * 1000 <= tier.tpot_ms)
        )


def _header_float(headers: httpx.Headers, name: str) -> float | None:
    value = headers.get(name)
    return float(value) if value else None


async def _read_stream(response: httpx.Response, outcome: Outcome) -> None:
    """Time the content deltas and read the usage chunk's token count into `outcome`."""
    async for line in response.aiter_lines():
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line.removeprefix("data: "))
        if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
            outcome.last_token_s = time.perf_counter()
            outcome.first_token_s = outcome.first_token_s or outcome.last_token_s
        usage = chunk.get("usage") or {}
        outcome.num_tokens = usage.get("completion_tokens", outcome.num_tokens)
    first_s, last_s = outcome.first_token_s, outcome.last_token_s
    if first_s is not None and last_s is not None:
        outcome.ttft_s = first_s - outcome.start_s
        if outcome.num_tokens > 1:
            outcome.tpot_s = (last_s - first_s) / (outcome.num_tokens - 1)


async def closed_loop(client: Client, streams: Sequence[str], seconds: float) -> float:
    """Each stream sends its tier's next request as its last one ends, until `seconds` have
    passed; a refused one waits its Retry-After first (at most MAX_RETRY_WAIT_S). Returns
    the time the loop started (perf_counter)."""
    start = time.perf_counter()
    deadline = start + seconds

    async def worker(tier: str) -> None:
        while time.perf_counter() < deadline:
            outcome = await client.chat(tier)
            if outcome.status in (429, 503):
                wait = min(outcome.retry_after_s or 1.0, MAX_RETRY_WAIT_S)
                await asyncio.sleep(min(wait, max(0.0, deadline - time.perf_counter())))

    await asyncio.gather(*(worker(tier) for tier in streams))
    return start


@dataclass(frozen=True)
class Window:
    """A phase's requests and the time its load ran."""

    outcomes: list[Outcome]
    start_s: float
    end_s: float
    cpu_shares: dict[str, float] = field(default_factory=dict)
    """Cores used by each kind of process over the window (bench/serving/cpu_shares.py)."""

    def tokens_per_s(self, pool: str | None = None) -> float:
        """Output tokens per second streamed within the window (by `pool`, if named)."""
        tokens = sum(
            o.tokens_within(self.start_s, self.end_s)
            for o in self.outcomes
            if pool is None or o.pool == pool
        )
        return tokens / (self.end_s - self.start_s)


async def timed(
    client: Client, streams: Sequence[str], seconds: float, settle_s: float = 0.0
) -> Window:
    """A closed loop over `streams` for `seconds`, its requests alone in the window; the
    window's throughput leaves out the first `settle_s`."""
    client.outcomes = []
    before = cpu_shares.sample()
    start = await closed_loop(client, streams, seconds)
    shares = cpu_shares.sample().shares_since(before)
    return Window(list(client.outcomes), start + settle_s, start + seconds, shares)


def goodput(client: Client, outcomes: list[Outcome], tier: str) -> float:
    """Share of the tier's admitted requests that met both SLOs (1.0 when none was admitted)."""
    admitted = [o for o in outcomes if o.tier == tier and o.status == 200]
    return sum(client.met_slo(o) for o in admitted) / len(admitted) if admitted else 1.0
