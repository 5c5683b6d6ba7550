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
   Then (tierserve only) the overload's interactive streams alone, nothing else
   running: what is refused of interactive demand alone, which batch work did not
   cause.
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

This module holds the phases and the two deployments; the client that times each request is
sla_client.py, and what is printed of the phases is sla_report.py.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.prompts import chat_turn
from bench.report import log
from bench.serving.sla_client import (
    PROMPT_TOKENS,
    TIERS,
    Client,
    Outcome,
    Window,
    goodput,
    timed,
)
from bench.serving.sla_report import report
from engine.model.chat import chat_prompt_ids
from engine.process import configure_process
from engine.sampling_params import SamplingParams
from serving.app_config import TierserveConfig, load_config
from serving.cache.config import SemanticCacheConfig
from testing.local_cluster import serving
from testing.serve_harness import request_logs

REFERENCE_TPOT_MS = 12.5
"""The batch-1 decode step the configured SLOs were written for."""
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


def overload_streams(plan: Plan) -> list[str]:
    """The overload's streams: `plan.concurrency` of them, tiers 1:1:1."""
    return [TIERS[i % 3] for i in range(plan.concurrency)]


def protect_streams(tiers: Sequence[str]) -> list[str]:
    """The protect phase's streams of the given tiers, PROTECT_MIX of each."""
    return [tier for tier in tiers for _ in range(PROTECT_MIX[tier])]


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


async def interactive_demand(client: Client, plan: Plan) -> Window:
    """The overload's interactive streams with nothing else running: what the deployment
    refuses of that demand alone (refusals beyond it under the overload are batch work's)."""
    streams = [tier for tier in overload_streams(plan) if tier == "interactive"]
    log(f"--- overload's interactive streams alone: {len(streams)} for {plan.overload_s:.0f} s")
    return await timed(client, streams, plan.overload_s, plan.settle_s)


async def offered_load(client: Client, rate: float, seconds: float, seed: int) -> None:
    """Open loop: Poisson arrivals at `rate` per second, tiers drawn 1:1:1."""
    rng, tasks = random.Random(seed), []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        tasks.append(asyncio.create_task(client.chat(rng.choice(TIERS))))
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)


def deployments(config: TierserveConfig, factor: float) -> dict[str, TierserveConfig]:
    """The two deployments compared, by name: tierserve as configured and one shared pool,
    both with the SLOs scaled by `factor` (tests build both, so neither breaks unseen)."""
    scaled = config.with_slos_scaled(factor)
    return {"tierserve": scaled, "shared pool": shared_config(scaled)}


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
                result["interactive_demand"] = await interactive_demand(client, plan)
            for i, rate in enumerate(plan.rates):
                client.outcomes = []
                log(f"--- {name}: {rate} requests/s for {plan.rate_s:.0f} s")
                await offered_load(client, rate, plan.rate_s, seed=i)
                result["rates"][rate] = goodput(client, client.outcomes, "interactive")
            result["client"] = client
            windows = [result["overload"], *result.get("protect", {}).values()]
            windows += [result["interactive_demand"]] if with_protect else []
            add_server_timings([o for window in windows for o in window.outcomes])
    return result


def add_server_timings(outcomes: Sequence[Outcome]) -> None:
    """Each admitted request's first token as the ingress and the engine saw it (their log
    lines), beside the client's: where a late first token waited; each refused request's
    reason and the prediction it was refused on."""
    time.sleep(1.0)  # the last lines reach the files a moment late
    lines = request_logs()
    for outcome in outcomes:
        fields = lines.get(outcome.request_id or "")
        if fields is None:
            continue
        outcome.server_ttft_ms = fields.get("ttft_ms")
        outcome.ttft_hops_ms = fields.get("ttft_hops_ms")
        if fields.get("status") == "refused":
            outcome.refusal_reason = fields.get("reason")
            outcome.predicted_ttft_ms = fields.get("predicted_ttft_ms")
            outcome.refusal_predictions_ms = fields.get("predictions_ms")


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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line: --quick, --config, --out, --slo-scale."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--config", type=Path, default=Path("configs/local.yaml"))
    parser.add_argument("--out", type=Path, default=Path("load_results"))
    parser.add_argument(
        "--slo-scale", type=float, help="scale the SLOs by this instead of the measured factor "
        "(runs compared one after another then hold the same SLOs)",
    )  # fmt: skip
    return parser.parse_args(argv)


def main() -> None:
    """Measure the machine, run both deployments, report."""
    args = parse_args()
    plan = QUICK if args.quick else FULL
    config = load_config(args.config)
    factor = args.slo_scale or machine_factor(config)
    log(f"SLOs scaled by {factor:.2f} (batch-1 decode step / {REFERENCE_TPOT_MS} ms, or as given)")
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
