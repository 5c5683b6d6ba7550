"""Memory and speed of INT8 / INT4 weights against bf16, measured in the same run.

Each variant's weights (quantized ones from a cached checkpoint, made once on
first use) are loaded into an LLMEngine in a fresh process to read its RSS;
then one process holds all variants and times batch-1 greedy decoding and 64
concurrent requests, round-robin, keeping each variant's best round. Ratios
are variant / bf16 (bigger is better); weight bytes count the linear layers
and the lm_head (tied to the embedding unless a variant quantizes it).
`bf16` names the unquantized model in the engine's own dtype: bf16 on a CPU with
native bf16 kernels, fp32 on the others (an AVX2-only CPU); the JSON's `dtype` says
which. `int4_a8` is INT4 with int8 activations (W4A8, engine/kernels/w4a8.c);
`int4_a8_head` adds the lm_head at INT4, `int4_a8_head8` at INT8 (W8A8), and
`int8_a8` is INT8 with int8 activations (W8A8).
Last, each quantized variant's top-1 agreement with the unquantized model
(`top1_agreement.<variant>`, bench/engine/quant_quality.py's quick prompt set), and beside them
what bf16 rounding alone gives on the same positions (`top1_agreement.unquantized_bf16_vs_fp32`).

    python -m bench.engine.bench_quant [--quick] [--variants bf16,int8,int4,int4_a8]
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time

import torch

from bench.engine.quant_quality import QUICK_PROMPTS, SCHEMES, evaluate, report_rounding_floor
from bench.report import emit
from engine.config import EngineConfig, QuantConfig, auto_dtype_name
from engine.engine import LLMEngine
from engine.model.batch_invariance import request_reproducible_blas
from engine.model.packed_linear import PackedLinear
from engine.quant.awq import DEFAULT_CALIBRATION_PATH
from engine.quant.linear import QuantLinear
from engine.quant.prepare import prepare_model
from engine.sampling_params import SamplingParams

VARIANTS: dict[str, QuantConfig | None] = {
    "bf16": None,
    "int8": QuantConfig("int8"),
    "int4": QuantConfig("int4", 64, "awq"),
    "int4_a8": QuantConfig("int4", 64, "awq", activations="int8"),
    "int4_a8_head": QuantConfig("int4", 64, "awq", quantize_lm_head=True, activations="int8"),
    "int4_a8_head8": QuantConfig(
        "int4", 64, "awq", quantize_lm_head=True, activations="int8", int8_layers=("lm_head",)
    ),
    "int8_a8": QuantConfig("int8", activations="int8"),
}
CONCURRENCY = 64
LINEARS = (torch.nn.Linear, QuantLinear, PackedLinear)


def linear_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every tensor held by the linear layers, the lm_head included: what a decode
    step reads (a tied lm_head reads the embedding; a quantized one, its own codes)."""
    total = 0
    for module in model.modules():
        if isinstance(module, LINEARS):
            total += sum(t.numel() * t.element_size() for t in module.state_dict().values())
    return total


def rss_bytes() -> int:
    """This process's resident memory after a garbage collection."""
    import psutil

    gc.collect()
    return psutil.Process().memory_info().rss


def decode_b1_tok_s(engine, prompt_ids: list[int], num_tokens: int) -> float:
    """Decode speed of one request: tokens after the first over the time after the first."""
    engine.add_request("b1", prompt_ids, _greedy(num_tokens))
    first = None
    while engine.has_unfinished():
        engine.step()
        first = first or time.perf_counter()
    return (num_tokens - 1) / (time.perf_counter() - first)


def throughput_tok_s(engine, prompts: list[list[int]], num_tokens: int) -> float:
    """Output tokens per second with every request submitted at once (prefill included)."""
    start = time.perf_counter()
    for i, prompt_ids in enumerate(prompts):
        engine.add_request(f"c{i}", prompt_ids, _greedy(num_tokens))
    while engine.has_unfinished():
        engine.step()
    return len(prompts) * num_tokens / (time.perf_counter() - start)


def _greedy(num_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)


def engine_config(variant: str, threads: int) -> EngineConfig:
    """The engine settings of one variant (bf16, int8, int4) at the benchmark's concurrency."""
    return EngineConfig(
        max_num_seqs=CONCURRENCY,
        kv_cache_memory_gb=0.25,
        enable_prefix_caching=False,  # every round must pay for its prefill
        num_threads=threads,
        quant=VARIANTS[variant],
    )


def build_engine(variant: str, threads: int) -> LLMEngine:
    """An engine for one variant."""
    return LLMEngine(engine_config(variant, threads))


def measure_memory(variant: str, threads: int) -> dict[str, float]:
    """Weight bytes and RSS of one variant's engine; runs in a process of its own."""
    engine = build_engine(variant, threads)
    return {"weight_bytes": linear_weight_bytes(engine.model), "rss_mb": rss_bytes() / 2**20}


def measure_speed(variants: list[str], quick: bool, threads: int) -> dict[str, dict[str, float]]:
    """Best of interleaved rounds: on a shared 2-core machine, neighbours' load comes and
    goes, and round-robin keeps it from landing on one variant only."""
    torch.set_num_threads(threads)
    engines = {variant: build_engine(variant, threads) for variant in variants}
    rows = [json.loads(line) for line in DEFAULT_CALIBRATION_PATH.read_text().splitlines()]
    prompts = [row["prompt_ids"] for row in rows if row["split"] == "eval"][:CONCURRENCY]
    best = {variant: {"decode_b1_tok_s": 0.0, "throughput64_tok_s": 0.0} for variant in variants}
    for _ in range(2 if quick else 3):
        for variant, engine in engines.items():
            decode_b1_tok_s(engine, prompts[0], 4)  # warm-up
            decode = decode_b1_tok_s(engine, prompts[1], 32 if quick else 128)
            batch = throughput_tok_s(engine, prompts, 16 if quick else 64)
            result = best[variant]
            result["decode_b1_tok_s"] = max(result["decode_b1_tok_s"], decode)
            result["throughput64_tok_s"] = max(result["throughput64_tok_s"], batch)
            print(
                f"{variant}: decode_b1 {decode:.1f} tok/s, c64 {batch:.1f} tok/s", file=sys.stderr
            )
    return best


def run_child(flag: str, variant: str, threads: int) -> dict[str, float] | None:
    """Measure one variant in a fresh process (clean memory); the memory figures when asked."""
    module = "bench.engine.bench_quant"
    command = [sys.executable, "-m", module, flag, variant, "--threads", str(threads)]
    out = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1]) if flag == "--memory" else None


def report(results: dict[str, dict[str, float]], common: dict) -> None:
    """Raw figures per variant, then ratios to bf16 named as ../shared/BENCHMARKS.md asks."""
    units = {"weight_bytes": "bytes", "rss_mb": "MiB", "decode_b1_tok_s": "tok/s",
             "throughput64_tok_s": "tok/s"}  # fmt: skip
    for variant, result in results.items():
        for key, unit in units.items():
            emit("quant", f"{key}.{variant}", result[key], unit, **common)
    base = results["bf16"]
    ratios = {"weight_bytes": "weight_bytes", "rss": "rss_mb", "decode_b1": "decode_b1_tok_s",
              "throughput64": "throughput64_tok_s"}  # fmt: skip
    for variant in (v for v in results if v != "bf16"):
        for name, key in ratios.items():
            ratio = results[variant][key] / base[key]
            emit("quant", f"ratio.{name}.{variant}_vs_bf16", ratio, "x", **common)


def report_quality(variants: list[str], common: dict) -> None:
    """Each quantized variant's top-1 agreement with the unquantized model on quant_quality's
    quick prompts (a copy quantized afresh in this process: the same maths as its engine)."""
    quantized = [v for v in variants if VARIANTS[v] is not None]
    schemes = [_quality_scheme(VARIANTS[v]) for v in quantized]
    results = evaluate(schemes, QUICK_PROMPTS, auto_dtype_name())
    for variant, result in zip(quantized, results, strict=True):
        emit("quant", f"top1_agreement.{variant}", result["top1_agreement"], "ratio",
             scheme=result["scheme"], n_prompts=QUICK_PROMPTS, **common)  # fmt: skip
    report_rounding_floor(QUICK_PROMPTS, n_prompts=QUICK_PROMPTS, **common)


def _quality_scheme(quant: QuantConfig | None) -> str:
    """The name bench/engine/quant_quality.py gives the same quantization."""
    return next(name for name, config in SCHEMES.items() if config == quant)


def main() -> None:
    """Prepare, measure and compare every variant; print JSON lines."""
    request_reproducible_blas()  # as pool replicas run (engine.process), before any matmul
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="shorter generations")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--memory", help=argparse.SUPPRESS)
    parser.add_argument("--prepare", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.prepare:  # the loader quantizes once (AWQ: a minute or so) and caches it
        prepare_model(engine_config(args.prepare, args.threads))
        return
    if args.memory:
        print(json.dumps(measure_memory(args.memory, args.threads)))
        return
    variants = ["bf16"] + [v for v in args.variants.split(",") if v != "bf16"]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    for variant in variants:
        if VARIANTS[variant] is not None:  # so no quantization work inflates the RSS figures
            run_child("--prepare", variant, args.threads)
    results: dict[str, dict[str, float]] = {}
    for variant in variants:
        results[variant] = run_child("--memory", variant, args.threads) or {}
    for variant, speed in measure_speed(variants, args.quick, args.threads).items():
        results[variant].update(speed)
    common = {"threads": args.threads, "dtype": auto_dtype_name(), "model": "default",
              "quick": args.quick,
              "int4": "g64 awq", "int4_a8": "g64 awq, int8 activations (W4A8)",
              "int4_a8_head": "int4_a8 with the lm_head quantized too",
              "int4_a8_head8": "int4_a8 with the lm_head at INT8 (W8A8)",
              "int8_a8": "int8 with int8 activations (W8A8)",
              "concurrency": CONCURRENCY}  # fmt: skip
    report(results, common)
    report_quality(variants, common)


if __name__ == "__main__":
    main()
