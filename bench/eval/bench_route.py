"""Routing to the small model: is the student fast enough to be worth it, good enough on the
requests the router sends it, and a good draft? All measured in one run.

  python -m bench.eval.bench_route [--quick] [--threads N] [--out DIR]

1. Speed: batch-1 decode and 64-request throughput (random-token prompts, EOS
   ignored) of the student and the default model, and each model's cost per 1k
   output tokens at that throughput on the same replica price.
2. Routing (RouteLLM-style): both models answer the labelled set
   (data/route/labelled.jsonl); the router is fitted on its train split with
   its threshold set to move half the traffic, and judged on the held-out eval
   split: quality kept against share moved, router vs random. The curve goes
   to <out>/route_curve.png with its JSON.
3. The student as the draft model on chat prompts, against no speculation.
4. How long the student took to distil (its model card).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from bench.engine.bench_engine import make_prompts, run_tierserve
from bench.engine.bench_spec import compare, load_prompts
from bench.report import emit, log, percentile
from engine.config import EngineConfig, SpecDecodeConfig
from engine.engine import LLMEngine
from engine.model.batch_invariance import request_reproducible_blas
from engine.model.students import CARD_FILE, latest_student
from engine.sampling_params import SamplingParams
from policies.difficulty import DifficultyModel, prompt_features
from small_model.data import LABELLED_SET
from small_model.distill.card import decode_tokens_per_s
from small_model.labels import RoutePrompt, label_prompts
from small_model.report import route_report
from small_model.router_fit import fit_difficulty_model

BENCH = "route"
SHARE = 0.5
PRICE_PER_REPLICA_HOUR = 0.05
"""One replica on one core, whichever model it runs (configs/local.yaml's pools)."""


def speed(default: LLMEngine, small: LLMEngine, cache_dir: Path, quick: bool) -> None:
    """Batch-1 decode and 64-request throughput of both models, and their cost per 1k."""
    b1_default = decode_tokens_per_s("default", cache_dir)
    b1_small = decode_tokens_per_s(str(latest_student(cache_dir)), cache_dir)
    emit(BENCH, "decode_b1_tok_s.default", b1_default, "tok/s")
    emit(BENCH, "decode_b1_tok_s.small", b1_small, "tok/s")
    emit(BENCH, "ratio.decode_b1.small_vs_default", b1_small / b1_default, "x")
    prompts = make_prompts(64, 60, 60, seed=0)
    max_tokens = 32 if quick else 128
    rates = {"default": run_tierserve(default, prompts, max_tokens)}
    rates["small"] = run_tierserve(small, prompts, max_tokens)
    for name, rate in rates.items():
        emit(BENCH, f"throughput64_tok_s.{name}", rate, "tok/s")
        micro_dollars = PRICE_PER_REPLICA_HOUR / (rate * 3600) * 1000 * 1e6
        emit(BENCH, f"cost_per_1k_tokens.{name}", micro_dollars, "micro-$", price_per_hour=0.05)
    ratio = rates["small"] / rates["default"]
    emit(BENCH, "ratio.throughput64.small_vs_default", ratio, "x")


def routing(default: LLMEngine, small: LLMEngine, quick: bool, out: Path) -> None:
    """Fit the router on the train split, judge it on the eval split."""
    rows = [json.loads(line) for line in LABELLED_SET.read_text().splitlines() if line.strip()]
    limit = 60 if quick else None
    splits = {
        split: [
            RoutePrompt(r["prompt"], r["max_tokens"], r["answer"])
            for r in rows
            if r["split"] == split
        ][:limit]
        for split in ("train", "eval")
    }
    fit_set = label_prompts(splits["train"], default, small)
    model = fit_difficulty_model([x.features for x in fit_set], [x.label for x in fit_set], SHARE)
    held_out = label_prompts(splits["eval"], default, small)
    report = route_report(model, held_out)
    report.save(out / "route_curve.json")
    model.save(out / "route_router.json")
    emit(BENCH, "quality_kept.router_at_50pct", report.router_at_half, "ratio")
    emit(BENCH, "quality_kept.random_at_50pct", report.random_at_half, "ratio")
    emit(BENCH, "router_auc_gain", report.auc_gain, "area")
    above = all(r >= q for r, q in zip(report.router[1:-1], report.random[1:-1], strict=True))
    emit(BENCH, "router_above_random_every_share", float(above), "bool")
    emit(BENCH, "router_threshold", report.threshold, "p", share=report.share_at_threshold)
    checkable = [x for x in held_out if x.prompt.answer is not None]
    for name in ("default", "small"):
        quality = [getattr(x, f"quality_{name}") for x in checkable]
        emit(BENCH, f"exact_match.{name}", sum(quality) / len(quality), "ratio", n=len(quality))
    overhead_ms = router_overhead_ms(model, [x.prompt for x in held_out])
    emit(BENCH, "router_overhead_ms.p95", percentile(overhead_ms, 95), "ms")
    curve = {"shares": report.shares, "router": report.router, "random": report.random}
    log(f"curve (eval split, {report.num_prompts} prompts): {json.dumps(curve)}")


def router_overhead_ms(model: DifficultyModel, prompts: list[RoutePrompt]) -> list[float]:
    """What the router adds to a request in the ingress: features from the request's text
    and token count, then the score; per call, in ms, over every prompt ten times."""
    times = []
    for prompt in prompts * 10:
        started = time.perf_counter()
        model.routes_to_small(
            prompt_features(prompt.text, len(prompt.text) // 4, prompt.max_tokens)
        )
        times.append((time.perf_counter() - started) * 1000)
    return times


def draft(cache_dir: Path, quick: bool) -> None:
    """TPOT of the default model on chat prompts with the student as its draft, and without."""
    base = EngineConfig(model="default", cache_dir=cache_dir, max_num_seqs=4, num_kv_blocks=256)
    spec = SpecDecodeConfig(method="draft", num_speculative_tokens=4, draft_model="student")
    plain, sped = LLMEngine(base), LLMEngine(dataclasses.replace(base, spec_decode=spec))
    prompts = load_prompts(plain, "chat", 4 if quick else None)
    params = SamplingParams(max_tokens=48 if quick else 96, temperature=0.0, ignore_eos=True)
    without, with_draft, counters, _, _ = compare(plain, sped, prompts, params)
    emit(BENCH, "tpot_ms.none.chat", without.tpot_ms, "ms")
    emit(BENCH, "tpot_ms.student.chat", with_draft.tpot_ms, "ms")
    emit(BENCH, "ratio.tpot_speedup.draft_chat", without.tpot_ms / with_draft.tpot_ms, "x")
    emit(BENCH, "acceptance_rate.student.chat", counters["acceptance_rate"], "ratio")
    emit(BENCH, "greedy_match_frac.student.chat", counters["greedy_match_frac"], "ratio")


def main() -> None:
    """Run the four parts on the newest student."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("load_results"))
    args = parser.parse_args()
    request_reproducible_blas()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    cache_dir = EngineConfig().cache_dir
    card = json.loads((latest_student(cache_dir) / CARD_FILE).read_text())
    log(f"student {card['name']}: {card['num_layers']} layers, {card['num_parameters']:,} params")
    emit(BENCH, "distill_minutes", card["distill_minutes"], "min", student=card["name"])
    default = LLMEngine(EngineConfig(model="default", cache_dir=cache_dir))
    small = LLMEngine(EngineConfig(model="student", cache_dir=cache_dir))
    speed(default, small, cache_dir, args.quick)
    routing(default, small, args.quick, args.out)
    draft(cache_dir, args.quick)


if __name__ == "__main__":
    main()
