"""The batch-size dial: sweep a pool's `max_num_seqs`, pick the largest that meets its tier's SLO.

  python -m bench.serving.sweep --pool offline --tier standard [--quick]
      [--write configs/tuned.yaml]

The config file holds what a product owner sets: each tier's SLO (TTFT, TPOT)
and, optionally, a cost ceiling per 1k output tokens. The sweep sets the knob:
for each batch cap it runs the pool's engine in process under a closed loop
that keeps more requests in flight than the cap (so a queue forms, as under
load), and measures output throughput, p95 TTFT and p50 TPOT. The largest cap
meeting the tier's TTFT and TPOT targets is chosen (a larger batch is cheaper
per token); its measured cost per 1k tokens is written beside it, so the
router can rank pools by cost. With `--write` the config is copied with the
chosen `max_num_seqs` and `cost_per_1k_tokens` set for the pool. A PNG plots
throughput against p95 TTFT and p50 TPOT, one point per cap.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from pathlib import Path
from typing import Any

import yaml

from bench.prompts import chat_turn
from bench.report import emit, log, percentile
from engine.engine import LLMEngine
from engine.model.chat import chat_prompt_ids
from engine.process import configure_process
from engine.sampling_params import SamplingParams
from policies.tiers import Tier
from serving.app_config import TierserveConfig, load_config, load_serve_config

BENCH = "sweep"
FULL_CAPS = (1, 2, 4, 8, 16, 32, 64)
QUICK_CAPS = (1, 4, 16)
IN_FLIGHT_FACTOR = 1.5
"""Requests kept in flight per batch slot: enough for a queue to form."""


@dataclasses.dataclass(frozen=True)
class Point:
    """What one batch cap delivered."""

    max_num_seqs: int
    throughput_tok_s: float
    ttft_ms_p95: float
    tpot_ms_p50: float
    cost_per_1k_tokens: float


def run_cap(
    engine: LLMEngine, prompts: list[list[int]], cap: int, max_tokens: int, price: float
) -> Point:
    """Closed loop at `cap`: keep IN_FLIGHT_FACTOR x cap requests in flight until all ran."""
    engine.scheduler.max_num_seqs = cap
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    pending = list(prompts)
    sent: dict[str, float] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    start_s, num_tokens = time.perf_counter(), 0
    while pending or engine.has_unfinished():
        while pending and len(engine.requests) < IN_FLIGHT_FACTOR * cap:
            request_id = f"r{len(sent)}"
            engine.add_request(request_id, pending.pop(), params)
            sent[request_id] = time.perf_counter()
        for out in engine.step():
            now = time.perf_counter()
            first.setdefault(out.request_id, now)
            last[out.request_id] = now
            num_tokens += len(out.new_token_ids)
    wall_s = time.perf_counter() - start_s
    ttft = [(first[r] - sent[r]) * 1000 for r in sent]
    tpot = [(last[r] - first[r]) * 1000 / (max_tokens - 1) for r in sent]
    throughput = num_tokens / wall_s
    return Point(
        max_num_seqs=cap,
        throughput_tok_s=throughput,
        ttft_ms_p95=percentile(ttft, 95),
        tpot_ms_p50=percentile(tpot, 50),
        cost_per_1k_tokens=price / 3600 / throughput * 1000,
    )


def choose(points: list[Point], tier: Tier) -> Point | None:
    """The largest cap meeting the tier's TTFT and TPOT targets and its cost ceiling
    (None: no cap does; the pool is too slow or too dear for the tier)."""
    ceiling = tier.max_cost_per_1k_tokens
    meeting = [
        p
        for p in points
        if p.ttft_ms_p95 <= tier.ttft_ms
        and p.tpot_ms_p50 <= tier.tpot_ms
        and (ceiling is None or p.cost_per_1k_tokens <= ceiling)
    ]
    return max(meeting, key=lambda p: p.max_num_seqs, default=None)


def write_config(source: Path, target: Path, pool: str, point: Point) -> None:
    """Copy the Serve config file with the pool's knobs set from the sweep."""
    serve_config = load_serve_config(source)
    args = serve_config["applications"][0]["args"]
    entry = next(p for p in args["pools"] if p["name"] == pool)
    entry.setdefault("engine", {})["max_num_seqs"] = point.max_num_seqs
    entry["cost_per_1k_tokens"] = round(point.cost_per_1k_tokens, 6)
    TierserveConfig.model_validate(args)  # the written file must still load
    target.write_text(yaml.safe_dump(serve_config, sort_keys=False))


def plot(points: list[Point], chosen: Point | None, path: Path, title: str) -> None:
    """Throughput against p95 TTFT and p50 TPOT, one labelled point per cap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for axis, values, label in (
        (left, [p.ttft_ms_p95 for p in points], "p95 TTFT (ms)"),
        (right, [p.tpot_ms_p50 for p in points], "p50 TPOT (ms)"),
    ):
        throughput = [p.throughput_tok_s for p in points]
        axis.plot(throughput, values, marker="o")
        for p, value in zip(points, values, strict=True):
            mark = " (chosen)" if chosen is not None and p == chosen else ""
            axis.annotate(f"b{p.max_num_seqs}{mark}", (p.throughput_tok_s, value))
        axis.set_xlabel("output tokens/s")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    """Sweep the caps, report each, choose, and optionally write the tuned config."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--config", type=Path, default=Path("configs/local.yaml"))
    parser.add_argument("--pool", default="offline")
    parser.add_argument("--tier", default="standard", help="whose SLO the pool must meet")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--write", type=Path, help="write the tuned Serve config here")
    parser.add_argument("--plot", type=Path, default=Path("sweep.png"))
    args = parser.parse_args()
    config = load_config(args.config)
    pool, tier = config.pool(args.pool), config.tier(args.tier)
    caps = QUICK_CAPS if args.quick else FULL_CAPS
    max_tokens = 16 if args.quick else 64
    engine_config = dataclasses.replace(pool.engine, max_num_seqs=max(caps))
    configure_process(engine_config)
    engine = LLMEngine(engine_config)
    rng = random.Random(0)
    points = []
    for cap in caps:
        prompts = [chat_prompt_ids(engine.tokenizer, chat_turn(128, rng)) for _ in range(2 * cap)]
        log(f"--- max_num_seqs={cap}: {len(prompts)} requests of {max_tokens} tokens")
        point = run_cap(engine, prompts, cap, max_tokens, pool.price_per_replica_hour)
        _emit_point(point, args.pool)
        points.append(point)
    chosen = choose(points, tier)
    _report_choice(chosen, args, tier.name)
    plot(points, chosen, args.plot, f"pool {args.pool} against tier {tier.name}'s SLO")
    if chosen is not None and args.write:
        write_config(args.config, args.write, args.pool, chosen)
        log(f"wrote {args.write}")


def _emit_point(point: Point, pool: str) -> None:
    extra: dict[str, Any] = {"pool": pool}
    b = f"b{point.max_num_seqs}"
    emit(BENCH, f"throughput_tok_s.{b}", point.throughput_tok_s, "tok/s", **extra)
    emit(BENCH, f"ttft_ms.p95.{b}", point.ttft_ms_p95, "ms", **extra)
    emit(BENCH, f"tpot_ms.p50.{b}", point.tpot_ms_p50, "ms", **extra)
    emit(BENCH, f"cost_per_1k.{b}", point.cost_per_1k_tokens, "usd", **extra)


def _report_choice(chosen: Point | None, args: argparse.Namespace, tier: str) -> None:
    if chosen is None:
        log(f"no cap meets tier {tier}'s SLO on pool {args.pool}: the pool is too slow for it")
        emit(BENCH, "chosen_max_num_seqs", 0, "seqs", pool=args.pool, tier=tier)
        return
    emit(BENCH, "chosen_max_num_seqs", chosen.max_num_seqs, "seqs", pool=args.pool, tier=tier)
    emit(BENCH, "chosen_cost_per_1k", chosen.cost_per_1k_tokens, "usd", pool=args.pool, tier=tier)


if __name__ == "__main__":
    main()
