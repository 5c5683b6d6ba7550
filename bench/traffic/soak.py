"""Soak: minutes of mixed-tier traffic with client disconnects, aborts, fuzzed bad requests and
(optionally) a pool replica killed midway; then a check that nothing hung, leaked or grew.

    .venv/bin/python -m bench.traffic.soak [--url http://127.0.0.1:8000]
        [--duration-s 600] [--quick]
    .venv/bin/python -m bench.traffic.soak --local [--config configs/local.yaml] [--kill-replica]

Every request ends in one `Outcome`. Three must stay at zero: `hung` (no answer within
the timeout), `plain_500` (a 5xx whose body is not OpenAI JSON) and `lost` (the exchange
ended with neither an answer nor an error). Once traffic stops, every pool's KV usage and
running and waiting counts (GET /metrics) must fall back to 0, and the resident memory of
the server's Serve processes should stay flat. Loopback servers only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

import httpx

from bench.report import emit, log
from bench.traffic.bad_requests import BAD_REQUESTS
from bench.traffic.server_probes import (
    idle_residue,
    kill_one_pool_replica,
    loopback_port,
    serve_rss_mb,
)

BENCH = "soak"
TIERS = ("interactive", "standard", "batch")
PROMPTS = ("Hi", "What is 2+2?", "Name a colour.", "Say yes.", "Count to three.", "Why?")
ACTION_WEIGHTS = {"complete": 30, "stream": 20, "disconnect": 20, "abort": 15, "bad": 15}
MAX_ABORT_DELAY_S = 0.5
WARMUP_FRACTION = 0.1
"""Share of the run (requests and time) done before the first memory reading."""


class Outcome(StrEnum):
    """How one request ended, from the client's side."""

    OK = "ok"
    """A full answer, or a stream through `data: [DONE]`."""
    ERROR = "error"
    """An OpenAI-format JSON error (any status), or an SSE error event before [DONE]."""
    DISCONNECTED = "disconnected"
    """We closed the stream after its first event, on purpose."""
    ABORTED = "aborted"
    """We gave up on purpose before the answer came."""
    HUNG = "hung"
    """Nothing within the request timeout."""
    PLAIN_500 = "plain_500"
    """A 5xx whose body is not an OpenAI error."""
    MALFORMED = "malformed"
    """Any other answer that is neither a completion nor an OpenAI error."""
    LOST = "lost"
    """The connection or the stream ended with neither an answer nor an error."""


@dataclass(frozen=True)
class SoakSettings:
    """How long and how hard to soak."""

    duration_s: float = 600.0
    concurrency: int = 16
    max_requests: int | None = None
    """Stop after this many requests, if the time has not run out first."""
    max_tokens: int = 16
    """Each valid request asks for 1 to this many tokens."""
    request_timeout_s: float = 60.0
    settle_timeout_s: float = 30.0
    """How long the pools get to drain once traffic stops."""
    seed: int = 0


@dataclass
class SoakReport:
    """What a soak found: outcome counts, what was still held once idle, memory growth."""

    outcomes: Counter[str]
    traffic_s: float
    """Seconds spent sending requests (the pauses to drain and read memory left out)."""
    leaked_kv_usage: float
    """KV-cache usage (0..1 per pool, summed over pools) still held after the pools drained."""
    leaked_requests: float
    """Requests still running or waiting in some engine after the pools drained."""
    rss_growth_mb: float
    """Resident memory of the Serve processes after the soak minus after the warm-up."""

    @property
    def num_requests(self) -> int:
        """Every request sent, whatever its outcome."""
        return sum(self.outcomes.values())

    def emit(self, **extra: Any) -> None:
        """Print the figures as bench JSON lines (bench/report.py)."""
        emit(BENCH, "soak.requests", self.num_requests, "requests", **extra)
        for outcome in Outcome:
            emit(BENCH, f"soak.{outcome.value}", self.outcomes[outcome], "requests", **extra)
        emit(BENCH, "soak.requests_per_s", self.num_requests / self.traffic_s, "req/s", **extra)
        emit(BENCH, "soak.leaked_kv_usage", self.leaked_kv_usage, "fraction", **extra)
        emit(BENCH, "soak.leaked_requests", self.leaked_requests, "requests", **extra)
        emit(BENCH, "soak.rss_growth_mb", self.rss_growth_mb, "MB", **extra)


# --- one request ----------------------------------------------------------------------------


def _json(content: bytes) -> Any:
    try:
        return json.loads(content)
    except ValueError:
        return None


def _is_openai_error(body: Any) -> bool:
    return isinstance(body, dict) and isinstance(body.get("error"), dict)


def classify(response: httpx.Response) -> Outcome:
    """The outcome of a whole (non-streamed) answer."""
    body = _json(response.content)
    if response.is_success:
        has_choices = isinstance(body, dict) and bool(body.get("choices"))
        return Outcome.OK if has_choices else Outcome.MALFORMED
    if _is_openai_error(body):
        return Outcome.ERROR
    return Outcome.PLAIN_500 if response.status_code >= 500 else Outcome.MALFORMED


async def read_stream(response: httpx.Response, stop_after_first: bool) -> Outcome:
    """Read SSE events to `[DONE]`, or leave after the first event when `stop_after_first`."""
    if response.status_code != 200:
        await response.aread()
        return classify(response)
    saw_error = False
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        payload = line.removeprefix("data: ")
        if payload == "[DONE]":
            return Outcome.ERROR if saw_error else Outcome.OK
        event = _json(payload.encode())
        if not isinstance(event, dict):
            return Outcome.MALFORMED
        saw_error = saw_error or _is_openai_error(event)
        if stop_after_first:
            return Outcome.DISCONNECTED
    return Outcome.LOST


@dataclass(frozen=True)
class Traffic:
    """Random valid requests for one server: its model name, tiers, prompts and token counts."""

    model: str
    max_tokens: int

    def request(self, rng: random.Random, stream: bool) -> tuple[str, dict, dict[str, str]]:
        """(path, JSON body, headers) of a valid request with a random tier, endpoint, sampling."""
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": rng.randint(1, self.max_tokens),
            "temperature": rng.choice((0.0, 0.8)),
            "seed": rng.randrange(2**31),
            "stream": stream,
        }
        headers: dict[str, str] = {}
        tier = rng.choice(TIERS)
        if rng.random() < 0.5:
            headers["X-SLA-Tier"] = tier
        else:
            body["tier"] = tier
        prompt = rng.choice(PROMPTS)
        if rng.random() < 0.5:
            body["messages"] = [{"role": "user", "content": prompt}]
            return "/v1/chat/completions", body, headers
        body["prompt"] = prompt
        return "/v1/completions", body, headers

    async def send(self, client: httpx.AsyncClient, action: str, rng: random.Random) -> Outcome:
        """Play one action: complete, stream, disconnect, abort, or bad."""
        if action == "bad":
            bad = rng.choice(BAD_REQUESTS)
            headers = {"Content-Type": "application/json", **bad.headers}
            response = await client.request(
                bad.method, bad.path, content=bad.content, headers=headers
            )
            return classify(response)
        path, body, headers = self.request(rng, stream=action in ("stream", "disconnect"))
        if action == "abort":
            try:
                post = client.post(path, json=body, headers=headers)
                response = await asyncio.wait_for(post, rng.uniform(0, MAX_ABORT_DELAY_S))
            except TimeoutError:
                return Outcome.ABORTED
            return classify(response)
        if body["stream"]:
            async with client.stream("POST", path, json=body, headers=headers) as response:
                return await read_stream(response, stop_after_first=action == "disconnect")
        return classify(await client.post(path, json=body, headers=headers))


async def one_request(
    client: httpx.AsyncClient, traffic: Traffic, action: str, rng: random.Random, timeout_s: float
) -> Outcome:
    """One action to its outcome; a timeout is `hung`, a dropped connection `lost`."""
    try:
        return await asyncio.wait_for(traffic.send(client, action, rng), timeout_s)
    except (TimeoutError, httpx.TimeoutException):
        return Outcome.HUNG
    except httpx.TransportError:  # refused, reset, or closed without an answer
        return Outcome.LOST


# --- the run --------------------------------------------------------------------------------


async def drive(
    client: httpx.AsyncClient, traffic: Traffic, settings: SoakSettings, rng: random.Random
) -> Counter[str]:
    """`settings.concurrency` clients sending random actions until the time or the count is up."""
    outcomes: Counter[str] = Counter()
    deadline_s = time.monotonic() + settings.duration_s
    budget = settings.max_requests if settings.max_requests is not None else math.inf
    actions, weights = list(ACTION_WEIGHTS), list(ACTION_WEIGHTS.values())
    issued = 0

    async def client_loop() -> None:
        nonlocal issued
        while time.monotonic() < deadline_s and issued < budget:
            issued += 1
            action = rng.choices(actions, weights)[0]
            timeout_s = settings.request_timeout_s
            outcomes[await one_request(client, traffic, action, rng, timeout_s)] += 1

    await asyncio.gather(*(client_loop() for _ in range(settings.concurrency)))
    return outcomes


async def soak(
    base_url: str,
    settings: SoakSettings,
    chaos: Callable[[], Awaitable[None]] | None = None,
) -> SoakReport:
    """Soak the server at `base_url` (loopback only): warm up, read memory, drive traffic
    (calling `chaos` once half way), wait for the pools to drain, read what is left."""
    port = loopback_port(base_url)
    rng = random.Random(settings.seed)
    limits = httpx.Limits(max_connections=2 * settings.concurrency)
    timeout = httpx.Timeout(settings.request_timeout_s)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as client:
        models = (await client.get("/v1/models")).json()
        traffic = Traffic(models["data"][0]["id"], settings.max_tokens)
        started_s = time.monotonic()
        outcomes = await drive(client, traffic, _share(settings, WARMUP_FRACTION), rng)
        traffic_s = time.monotonic() - started_s
        await idle_residue(client, settings.settle_timeout_s)
        rss_before_mb = serve_rss_mb(port)
        main = _share(settings, 1 - WARMUP_FRACTION)
        chaos_task = asyncio.create_task(_after(main.duration_s / 2, chaos)) if chaos else None
        started_s = time.monotonic()
        outcomes += await drive(client, traffic, main, rng)
        traffic_s += time.monotonic() - started_s
        if chaos_task is not None:
            chaos_task.cancel()
        residue = await idle_residue(client, settings.settle_timeout_s)
    rss_after_mb = serve_rss_mb(port)
    log(f"soak: Serve RSS {rss_before_mb:.0f} MB after warm-up, {rss_after_mb:.0f} MB at the end")
    return SoakReport(
        outcomes=outcomes,
        traffic_s=traffic_s,
        leaked_kv_usage=residue["vllm:kv_cache_usage_perc"],
        leaked_requests=residue["vllm:num_requests_running"] + residue["vllm:num_requests_waiting"],
        rss_growth_mb=rss_after_mb - rss_before_mb,
    )


def _share(settings: SoakSettings, fraction: float) -> SoakSettings:
    count = settings.max_requests
    return replace(
        settings,
        duration_s=settings.duration_s * fraction,
        max_requests=None if count is None else max(1, round(count * fraction)),
    )


async def _after(delay_s: float, action: Callable[[], Awaitable[None]]) -> None:
    await asyncio.sleep(delay_s)
    await action()


# --- the command ----------------------------------------------------------------------------


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="a running server")
    parser.add_argument("--local", action="store_true", help="start the app on a private cluster")
    parser.add_argument("--config", type=Path, default=Path("configs/local.yaml"))
    parser.add_argument("--kill-replica", action="store_true", help="with --local: chaos")
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-requests", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--request-timeout-s", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="about 60 s of traffic")
    args = parser.parse_args()
    if args.kill_replica and not args.local:
        parser.error("--kill-replica needs --local (it kills with ray.kill on its own cluster)")
    return args


def main() -> None:
    """Soak a running server, or the app started here on a private local cluster."""
    args = _parse_args()
    settings = SoakSettings(
        duration_s=60.0 if args.quick else args.duration_s,
        concurrency=args.concurrency,
        max_requests=args.max_requests,
        max_tokens=args.max_tokens,
        request_timeout_s=args.request_timeout_s,
        seed=args.seed,
    )
    extra = {"concurrency": settings.concurrency, "duration_s": settings.duration_s}
    if not args.local:
        asyncio.run(soak(args.url, settings)).emit(**extra)
        return
    from serving.app_config import load_config
    from testing.local_cluster import serving

    chaos_rng = random.Random(settings.seed + 1)
    chaos = (lambda: kill_one_pool_replica("tierserve", chaos_rng)) if args.kill_replica else None
    with serving(load_config(args.config)) as url:
        report = asyncio.run(soak(url, settings, chaos))
    report.emit(**extra, kill_replica=args.kill_replica)


if __name__ == "__main__":
    main()
