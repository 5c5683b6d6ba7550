"""SLA benchmark: tiers competing under overload, tierserve against one shared pool.

  python -m bench.serving.bench_sla [--quick] [--config configs/local.yaml] [--out DIR]

Two deployments on the same cores, one after the other, each on a private
local Ray cluster: tierserve as configured (interactive and offline pools,
placement on predicted latency), and the naive alternative: one shared pool
with one batch size, every tier first come first served.

1. Overload: N closed-loop workers stream chat completions, tiers
   interactive:standard:batch = 1:1:1, 64 output tokens (EOS ignored), after
   a warm-up wave that is not counted; a refused request's worker waits
   its Retry-After before its next. Per tier: goodput (share of admitted
   requests meeting both SLOs), sheds, and sheds of interactive requests while
   batch requests were running; output tokens per second against the shared pool.
2. Protect (tierserve only): a light interactive load, well within what the
   interactive pool serves alone (PROTECT_MIX), beside a heavy standard and
   batch load, against the same deployment with the interactive load alone and
   with the background load alone: the interactive TPOT beside over alone, its
   goodput, and the offline pool's output tokens per second beside the
   interactive load over without it (is the urgent pool protected, and does the
   offline pool still use what it leaves idle).
3. Offered load: open-loop Poisson arrivals at rising rates, the same mix; the
   interactive goodput of each deployment at each rate. Reported: tierserve's
   interactive goodput at the lowest rate where the shared pool's falls to
   70% or below.
4. Cost per 1k output tokens of each pool after the overload (the ingress's
   `tierserve:cost_per_1k_output_tokens`), and per pool the TTFT and TPOT
   prediction error under the overload (measured against the
   `x-tierserve-predicted-ttft-ms` and `-tpot-ms` headers).

SLOs scale with the machine: the configured TTFT and TPOT targets assume a
batch-1 decode step of REFERENCE_TPOT_MS; they are multiplied by the measured
batch-1 step over that (never below 1), so the benchmark measures the control
plane rather than the CPU. The factor is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.prompts import chat_turn
from bench.report import emit, log, percentile
from bench.serving import cpu_shares
from engine.model.chat import chat_prompt_ids
from engine.process import configure_process
from engine.sampling_params import SamplingParams
from policies.tiers import Tier
from serving.app_config import TierserveConfig, load_config
from serving.cache.config import SemanticCacheConfig
from testing.local_cluster import serving
from testing.serve_harness import request_logs

BENCH = "sla"
TIERS = ("interactive", "standard", "batch")
REFERENCE_TPOT_MS = 12.5
"""The batch-1 decode step the configured SLOs were written for."""
PROMPT_TOKENS = 128
OUTPUT_TOKENS = 64
SHARED_MAX_NUM_SEQS = 16
WARM_UP_PER_TIER = 2
"""A serving deployment is warm: each engine has fitted its step cost before the clock runs."""


@dataclass(frozen=True)
class Plan:
    """Sizes of one benchmark run."""

    concurrency: int
    overload_s: float
    rates: tuple[float, ...]
    """Offered loads, requests per second."""
    rate_s: float
    protect_s: float
    """Each of the protect phase's three parts: interactive alone, background alone, both."""
    settle_s: float
    """The start of each closed-loop phase left out of its throughput: the first wave's
    prompts are all prefilled at once, before the load is steady."""


FULL = Plan(
    concurrency=48, overload_s=60, rates=(0.5, 1, 2, 4), rate_s=40, protect_s=45, settle_s=15
)
QUICK = Plan(concurrency=24, overload_s=30, rates=(1, 3), rate_s=12, protect_s=30, settle_s=10)
PROTECT_MIX = {"interactive": 2, "standard": 8, "batch": 24}
"""Closed-loop streams per tier in the protect phase (the issue's reproduction): 2
interactive streams, well within the interactive pool's batch, beside a heavy load."""
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
            if r.status_code != 200:
                outcome.batch_running_at_refusal = self.batch_running
                outcome.retry_after_s = _header_float(r.headers, "retry-after")
                await r.aread()
                return
            outcome.pool = r.headers.get("x-tierserve-pool")
            outcome.request_id = r.headers.get("x-tierserve-request-id")
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


def overload_streams(plan: Plan) -> list[str]:
    """The overload's streams: `plan.concurrency` of them, tiers 1:1:1."""
    return [TIERS[i % 3] for i in range(plan.concurrency)]


def protect_streams(tiers: Sequence[str]) -> list[str]:
    """The protect phase's streams of the given tiers, PROTECT_MIX of each."""
    return [tier for tier in tiers for _ in range(PROTECT_MIX[tier])]


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


async def protect(client: Client, plan: Plan) -> dict[str, Window]:
    """The interactive load alone, the background load alone, then both together."""
    background = ("standard", "batch")
    phases = {
        "alone": protect_streams(("interactive",)),
        "no_interactive": protect_streams(background),
        "protect": protect_streams(("interactive", *background)),
    }
    windows = {}
    for name, streams in phases.items():
        log(f"--- protect phase, {name}: {len(streams)} streams for {plan.protect_s:.0f} s")
        windows[name] = await timed(client, streams, plan.protect_s, plan.settle_s)
    return windows


async def offered_load(client: Client, rate: float, seconds: float, seed: int) -> None:
    """Open loop: Poisson arrivals at `rate` per second, tiers drawn 1:1:1."""
    rng, tasks = random.Random(seed), []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        tasks.append(asyncio.create_task(client.chat(rng.choice(TIERS))))
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)


def goodput(client: Client, outcomes: list[Outcome], tier: str) -> float:
    """Share of the tier's admitted requests that met both SLOs (1.0 when none was admitted)."""
    admitted = [o for o in outcomes if o.tier == tier and o.status == 200]
    return sum(client.met_slo(o) for o in admitted) / len(admitted) if admitted else 1.0


def deployments(config: TierserveConfig, factor: float) -> dict[str, TierserveConfig]:
    """The two deployments compared, by name: tierserve as configured and one shared pool,
    both with the SLOs scaled by `factor` (tests build both, so neither breaks unseen)."""
    scaled = config.with_changes(tiers=scaled_tiers(config, factor))
    return {"tierserve": scaled, "shared pool": shared_config(scaled)}


def scaled_tiers(config: TierserveConfig, factor: float) -> tuple[Tier, ...]:
    """The configured tiers with TTFT and TPOT targets multiplied by `factor`."""
    return tuple(
        t.model_copy(update={"ttft_ms": t.ttft_ms * factor, "tpot_ms": t.tpot_ms * factor})
        for t in config.tiers
    )


def shared_config(config: TierserveConfig) -> TierserveConfig:
    """One pool, one batch size, every tier first come first served; no small model and no
    semantic cache (their pools are not there, and both are levers compared against)."""
    base = config.pool("interactive")
    engine = dataclasses.replace(base.engine, max_num_seqs=SHARED_MAX_NUM_SEQS, spec_decode=None)
    pool = base.model_copy(update={"name": "shared", "engine": engine, "max_queued_requests": 4096})
    tiers = tuple(
        t.model_copy(
            update={"pool": "shared", "overflow_pool": None, "priority": 0, "on_slo_miss": "queue"}
        )  # fmt: skip
        for t in config.tiers
    )
    return config.with_changes(
        pools=(pool,), tiers=tiers, small_model=None, semantic_cache=SemanticCacheConfig()
    )


def machine_factor(config: TierserveConfig) -> float:
    """Measured batch-1 decode step of the interactive engine over REFERENCE_TPOT_MS (>= 1)."""
    from engine.engine import LLMEngine  # torch and the model: only this step needs them

    engine_config = config.pool("interactive").engine
    configure_process(engine_config)
    engine = LLMEngine(engine_config)
    prompt = chat_prompt_ids(engine.tokenizer, chat_turn(PROMPT_TOKENS, random.Random(1)))
    engine.add_request(
        "probe", prompt, SamplingParams(max_tokens=33, temperature=0, ignore_eos=True)
    )
    times = []
    while engine.has_unfinished():
        engine.step()
        times.append(time.perf_counter())
    tpot_ms = (times[-1] - times[1]) / (len(times) - 2) * 1000
    return max(1.0, tpot_ms / REFERENCE_TPOT_MS)


async def run_deployment(
    name: str, config: TierserveConfig, plan: Plan, with_protect: bool
) -> dict[str, Any]:
    """The phases against one deployment (the protect phase when asked); returns what the
    report needs."""
    tiers = {t.name: t for t in config.tiers}
    result: dict[str, Any] = {"rates": {}}
    with serving(config) as base_url:
        async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
            client = Client(http, tiers, config.model_name)
            log(f"--- {name}: warm-up, {WARM_UP_PER_TIER} requests per tier (not counted)")
            await asyncio.gather(*(client.chat(t) for t in TIERS * WARM_UP_PER_TIER))
            log(f"--- {name}: overload, {plan.concurrency} streams for {plan.overload_s:.0f} s")
            streams = overload_streams(plan)
            result["overload"] = await timed(client, streams, plan.overload_s, plan.settle_s)
            result["cost"] = await pool_costs(http)
            if with_protect:
                result["protect"] = await protect(client, plan)
            for i, rate in enumerate(plan.rates):
                client.outcomes = []
                log(f"--- {name}: {rate} requests/s for {plan.rate_s:.0f} s")
                await offered_load(client, rate, plan.rate_s, seed=i)
                result["rates"][rate] = goodput(client, client.outcomes, "interactive")
            result["client"] = client
            windows = [result["overload"], *result.get("protect", {}).values()]
            add_server_timings([o for window in windows for o in window.outcomes])
    return result


def add_server_timings(outcomes: Sequence[Outcome]) -> None:
    """Each admitted request's first token as the ingress and the engine saw it (their log
    lines), beside the client's: where a late first token waited."""
    time.sleep(1.0)  # the last lines reach the files a moment late
    lines = request_logs()
    for outcome in outcomes:
        fields = lines.get(outcome.request_id or "")
        if fields is not None:
            outcome.server_ttft_ms = fields.get("ttft_ms")
            outcome.ttft_hops_ms = fields.get("ttft_hops_ms")


async def pool_costs(http: httpx.AsyncClient) -> dict[str, float]:
    """`tierserve:cost_per_1k_output_tokens` per pool, from the ingress's /metrics."""
    text = (await http.get("/metrics")).text
    costs = {}
    for line in text.splitlines():
        if line.startswith("tierserve:cost_per_1k_output_tokens{"):
            labels, value = line.rsplit(" ", 1)
            pool = labels.split('pool="', 1)[1].split('"', 1)[0]
            costs[pool] = float(value)
    return costs


def report(ours: dict[str, Any], shared: dict[str, Any], factor: float, out: Path) -> None:
    """The JSON lines of BENCHMARKS.md's SLA section, a goodput-vs-load plot, and the
    overload's and protect phase's requests one per line (for reading misses one by one)."""
    extra = {"slo_scale": round(factor, 2)}
    _report_overload(ours, shared, extra)
    _report_protect(ours["client"], ours["protect"], extra)
    _report_load_sweep(ours["rates"], shared["rates"], extra)
    costs = ours["cost"]
    if costs.get("interactive"):
        ratio = costs.get("offline", 0.0) / costs["interactive"]
        emit(BENCH, "ratio.cost_per_1k.offline_vs_interactive", ratio, "x", **extra, **costs)
    _report_prediction_error(ours["client"], ours["overload"].outcomes, extra)
    _report_ttft_breakdown(ours["overload"].outcomes, extra)
    for phase, window in {"overload": ours["overload"], **ours["protect"]}.items():
        for kind, cores in window.cpu_shares.items():
            if cores >= 0.01:
                emit(BENCH, f"cpu_cores.{phase}.{kind}", cores, "cores", **extra)
    _plot(ours["rates"], shared["rates"], out / "sla_goodput_vs_load.png")
    phases = {"overload": ours["overload"], **ours["protect"]}
    for name, window in phases.items():
        with open(out / f"sla_{name}_requests.jsonl", "w") as f:
            for outcome in window.outcomes:
                f.write(json.dumps(dataclasses.asdict(outcome)) + "\n")


def _report_overload(ours: dict[str, Any], shared: dict[str, Any], extra: dict) -> None:
    """Goodput and sheds per tier, against the shared pool's, and the tokens per second."""
    client: Client = ours["client"]
    outcomes, shared_outcomes = ours["overload"].outcomes, shared["overload"].outcomes
    for tier in TIERS:
        emit(BENCH, f"goodput.{tier}.overload", goodput(client, outcomes, tier), "share", **extra)
        shed = sum(o.tier == tier and o.status == 429 for o in outcomes)
        emit(BENCH, f"shed.{tier}.overload", shed, "requests", **extra)
        emit(BENCH, f"goodput.{tier}.overload.shared",
             goodput(shared["client"], shared_outcomes, tier), "share", **extra)  # fmt: skip
    refused = [o for o in outcomes if o.tier == "interactive" and o.status == 429]
    emit(BENCH, "shed.interactive_while_batch_running",
         sum(o.batch_running_at_refusal > 0 for o in refused), "requests", **extra)  # fmt: skip
    ours_tok_s, shared_tok_s = ours["overload"].tokens_per_s(), shared["overload"].tokens_per_s()
    emit(BENCH, "ratio.output_tokens_per_s.overload.tierserve_vs_shared",
         ours_tok_s / max(shared_tok_s, 1e-9), "x", tierserve=round(ours_tok_s, 1),
         shared=round(shared_tok_s, 1), **extra)  # fmt: skip


def _report_protect(client: Client, windows: dict[str, Window], extra: dict) -> None:
    """Interactive TPOT beside the heavy load over alone, its goodput, offline throughput."""
    tpots = {
        name: [o.tpot_s for o in windows[name].outcomes if o.tier == "interactive" and o.tpot_s]
        for name in ("alone", "protect")
    }
    for q in (50, 95):
        if not (tpots["alone"] and tpots["protect"]):
            log("no interactive request streamed in the alone or protect window: no TPOT ratio")
            break
        alone, beside = percentile(tpots["alone"], q), percentile(tpots["protect"], q)
        emit(BENCH, f"ratio.interactive_tpot.protect_vs_alone.p{q}", beside / alone, "x",
             protect_ms=round(beside * 1000, 1), alone_ms=round(alone * 1000, 1),
             n=len(tpots["protect"]), **extra)  # fmt: skip
    protected = windows["protect"].outcomes
    emit(BENCH, "goodput.interactive.protect", goodput(client, protected, "interactive"),
         "share", **extra)  # fmt: skip
    refused = sum(o.tier == "interactive" and o.status != 200 for o in protected)
    emit(BENCH, "shed.interactive.protect", refused, "requests", **extra)
    beside, without = (windows[n].tokens_per_s("offline") for n in ("protect", "no_interactive"))
    if without > 0:
        emit(BENCH, "ratio.offline_throughput.protect_vs_no_interactive", beside / without,
             "x", protect_tok_s=round(beside, 1), no_interactive_tok_s=round(without, 1),
             **extra)  # fmt: skip


def _report_load_sweep(ours: dict[float, float], shared: dict[float, float], extra: dict) -> None:
    for rate in ours:
        emit(BENCH, f"goodput.interactive.rate{rate}", ours[rate], "share", **extra)
        emit(BENCH, f"goodput.interactive.rate{rate}.shared", shared[rate], "share", **extra)
    over = [rate for rate in sorted(shared) if shared[rate] <= 0.7]
    if over:
        emit(
            BENCH,
            "goodput.interactive.tierserve_at_shared70",
            ours[over[0]],
            "share",
            rate=over[0],
            **extra,
        )
    else:
        log("the shared pool kept interactive goodput above 70% at every rate: raise the rates")


def prediction_errors(outcomes: list[Outcome]) -> dict[str, dict[str, list[float]]]:
    """Per pool, the measured minus predicted TTFT and TPOT (ms) of each admitted request."""
    errors: dict[str, dict[str, list[float]]] = {}
    for o in outcomes:
        pool = errors.setdefault(o.pool or "none", {"ttft": [], "tpot": []})
        if o.ttft_s is not None and o.predicted_ttft_ms is not None:
            pool["ttft"].append(o.ttft_s * 1000 - o.predicted_ttft_ms)
        if o.tpot_s is not None and o.predicted_tpot_ms is not None:
            pool["tpot"].append(o.tpot_s * 1000 - o.predicted_tpot_ms)
    return {name: pool for name, pool in errors.items() if pool["ttft"]}


def ttft_error_share_of_slo(client: Client, outcomes: list[Outcome]) -> dict[str, float]:
    """Per tier, the median absolute TTFT prediction error over the tier's (scaled) TTFT
    SLO: the issue's target reads it against the SLO the prediction is placed by."""
    errors: dict[str, list[float]] = {}
    for o in outcomes:
        if o.ttft_s is not None and o.predicted_ttft_ms is not None:
            errors.setdefault(o.tier, []).append(abs(o.ttft_s * 1000 - o.predicted_ttft_ms))
    return {
        tier: percentile(tier_errors, 50) / client.tiers[tier].ttft_ms
        for tier, tier_errors in errors.items()
    }


def _report_prediction_error(client: Client, outcomes: list[Outcome], extra: dict) -> None:
    """The absolute error's percentiles over all pools and per pool, the TTFT bias, and per
    tier the median TTFT error as a share of the tier's SLO."""
    per_pool = prediction_errors(outcomes)
    every = {
        kind: [e for pool in per_pool.values() for e in pool[kind]] for kind in ("ttft", "tpot")
    }
    if every["ttft"]:
        emit(BENCH, "prediction_bias_ms.ttft.p50", percentile(every["ttft"], 50), "ms", **extra)
    for suffix, errors in [("", every), *((f".{name}", e) for name, e in per_pool.items())]:
        for kind, quantiles in (("ttft", (50, 95)), ("tpot", (50,))):
            absolute = [abs(e) for e in errors[kind]]
            for q in quantiles if absolute else ():
                emit(
                    BENCH,
                    f"prediction_error_ms.{kind}.p{q}{suffix}",
                    percentile(absolute, q),
                    "ms",
                    n=len(absolute),
                    **extra,
                )
    for tier, share in ttft_error_share_of_slo(client, outcomes).items():
        emit(BENCH, f"prediction_error_share_of_slo.ttft.p50.{tier}", share, "share", **extra)


def _report_ttft_breakdown(outcomes: list[Outcome], extra: dict) -> None:
    """Per pool and tier, the median first token as the client and the ingress saw it, and
    the ingress's median of each hop on the way (serving/http/streaming.py)."""
    groups: dict[tuple[str, str], list[Outcome]] = {}
    for o in outcomes:
        if o.ttft_s is not None and o.server_ttft_ms is not None and o.ttft_hops_ms:
            groups.setdefault((o.pool or "none", o.tier), []).append(o)
    for (pool, tier), group in sorted(groups.items()):
        parts = {
            "client": percentile([o.ttft_s * 1000 for o in group if o.ttft_s], 50),
            "ingress": percentile([o.server_ttft_ms or 0.0 for o in group], 50),
        }
        for hop in group[0].ttft_hops_ms or {}:
            parts[hop] = percentile([(o.ttft_hops_ms or {}).get(hop) or 0.0 for o in group], 50)
        for part, value in parts.items():
            emit(BENCH, f"ttft_breakdown_ms.p50.{pool}.{tier}.{part}", value, "ms",
                 n=len(group), **extra)  # fmt: skip


def _plot(ours: dict[float, float], shared: dict[float, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(6, 4))
    axis.plot(list(ours), list(ours.values()), marker="o", label="tierserve")
    axis.plot(list(shared), list(shared.values()), marker="s", label="one shared pool")
    axis.axhline(0.7, color="grey", linestyle=":")
    axis.set_xlabel("offered load (requests/s, tiers 1:1:1)")
    axis.set_ylabel("interactive goodput (share meeting SLO)")
    axis.set_ylim(0, 1.05)
    axis.legend()
    axis.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    log(f"wrote {path}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line: --quick, --config, --out."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--config", type=Path, default=Path("configs/local.yaml"))
    parser.add_argument("--out", type=Path, default=Path("load_results"))
    return parser.parse_args(argv)


def main() -> None:
    """Measure the machine, run both deployments, report."""
    args = parse_args()
    plan = QUICK if args.quick else FULL
    config = load_config(args.config)
    factor = machine_factor(config)
    log(f"SLOs scaled by {factor:.2f} (batch-1 decode step / {REFERENCE_TPOT_MS} ms)")
    results = {
        name: asyncio.run(run_deployment(name, deployment, plan, name == "tierserve"))
        for name, deployment in deployments(config, factor).items()
    }
    ours = results["tierserve"]
    args.out.mkdir(parents=True, exist_ok=True)
    report(ours, results["shared pool"], factor, args.out)
    refusals = [o.tier for o in ours["overload"].outcomes if o.status == 429]
    summary = {t: refusals.count(t) for t in TIERS}
    log(f"429s per tier under overload: {json.dumps(summary)}")


if __name__ == "__main__":
    main()
