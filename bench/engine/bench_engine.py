"""Engine benchmark: tierserve's engine against transformers, measured in one run.

  python -m bench.engine.bench_engine [--quick] [--threads N]

(a) tierserve, all requests submitted at once; (b) transformers `generate`
one request at a time (the naive server); (c) transformers static batches of
8, left-padded. All in the engine's dtype, 128 output tokens with EOS ignored,
prompts of 100-500 tokens drawn with a fixed seed. The baselines are rates
(tok/s), so they are measured on a leading subset of the same requests to keep
the run short; the subset size is printed. Then where a decode step's time
goes with every request running (bench/engine/step_profile.py; `share.decode.c<n>.*`,
with `outside_matmul_attention` the norms, activations, residuals, step
preparation and sampling; `hook_cost` is what the profiler's own hooks added, left
out), batch-1 decode speed, and TTFT of 16 requests sharing a 1,000-token system
prompt with and without prefix caching.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from bench.engine.step_profile import PARTS, profile_steps, step_until_decoding
from bench.report import emit, log
from engine.config import EngineConfig, auto_dtype_name
from engine.engine import LLMEngine
from engine.model.batch_invariance import request_reproducible_blas
from engine.model.loader import resolve_model_dir
from engine.sampling_params import SamplingParams

DTYPE = auto_dtype_name()
"""Both sides run in the dtype `auto` resolves to here: bf16 where the CPU has native bf16
kernels, fp32 on the others (emulated bf16 would measure the emulation)."""
VOCAB_LOW, VOCAB_HIGH = 1000, 40000  # ordinary BPE tokens, away from the special ones


def make_prompts(n: int, low: int, high: int, seed: int) -> list[list[int]]:
    """`n` random-token prompts (ordinary BPE ids) of low..high tokens: nothing to cache."""
    rng = random.Random(seed)
    return [
        [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(rng.randint(low, high))]
        for _ in range(n)
    ]


def run_tierserve(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> float:
    """Output tok/s with every request submitted at once."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    num_tokens = run_to_completion(engine, prompts, params)
    return num_tokens / (time.perf_counter() - start)


def run_to_completion(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> int:
    """Submit every prompt at once and step until all are done; the output tokens made."""
    for prompt in prompts:
        engine.add_request(f"bench-{time.perf_counter_ns()}", prompt, params)
    num_tokens = 0
    while engine.has_unfinished():
        num_tokens += sum(len(o.new_token_ids) for o in engine.step())
    return num_tokens


def hf_generate(hf, batch: list[list[int]], max_tokens: int, pad_id: int) -> int:
    """One left-padded transformers `generate` call; returns the tokens it produced."""
    width = max(len(p) for p in batch)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    out = hf.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
        pad_token_id=pad_id,
    )
    return (out.shape[1] - width) * len(batch)


def run_hf(hf, prompts: list[list[int]], batch_size: int, max_tokens: int, pad_id: int) -> float:
    """transformers' output tok/s over `prompts` in static batches of `batch_size`."""
    start, num_tokens = time.perf_counter(), 0
    for i in range(0, len(prompts), batch_size):
        num_tokens += hf_generate(hf, prompts[i : i + batch_size], max_tokens, pad_id)
    return num_tokens / (time.perf_counter() - start)


def decode_b1_tierserve(engine: LLMEngine, prompt: list[int], max_tokens: int) -> float:
    """Tokens/s after the first token, one request alone."""
    engine.add_request(
        "b1", prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    )
    first, n = None, 0
    while engine.has_unfinished():
        n += sum(len(o.new_token_ids) for o in engine.step())
        first = first or time.perf_counter()
    return (n - 1) / (time.perf_counter() - first)


def decode_b1_hf(hf, prompt: list[int], max_tokens: int, pad_id: int) -> float:
    """transformers decode rate: a full run minus a 1-token run (its prefill)."""
    t0 = time.perf_counter()
    hf_generate(hf, [prompt], 1, pad_id)
    t1 = time.perf_counter()
    hf_generate(hf, [prompt], max_tokens, pad_id)
    t2 = time.perf_counter()
    return (max_tokens - 1) / ((t2 - t1) - (t1 - t0))


def mean_ttft_ms(engine: LLMEngine, prompts: list[list[int]]) -> float:
    """Mean time to first token of requests sent one after another."""
    params = SamplingParams(max_tokens=1, temperature=0)
    total = 0.0
    for i, prompt in enumerate(prompts):
        start = time.perf_counter()
        engine.add_request(f"ttft-{i}", prompt, params)
        while engine.has_unfinished():
            engine.step()
        total += time.perf_counter() - start
    return total / len(prompts) * 1000


def report_decode_profile(engine: LLMEngine, prompts: list[list[int]], common: dict) -> None:
    """Each part's share of decode steps with every prompt running (prefill done first)."""
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    request_ids = {f"profiled-{i}" for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"profiled-{i}", prompt, params)
    step_until_decoding(engine, request_ids)
    shares = profile_steps(engine, every_other=True)
    name = f"share.decode.c{len(prompts)}"
    for part in (*PARTS, "hook_cost"):
        emit("engine", f"{name}.{part}", shares[part], "x", **common)
    outside = shares["other_model"] + shares["outside_model"]
    emit("engine", f"{name}.outside_matmul_attention", outside, "x", **common)


def engine_config(args: argparse.Namespace, **overrides) -> EngineConfig:
    """The benchmark's engine settings (the engine's dtype, 64 sequences), with `overrides`."""
    base = dict(
        dtype=DTYPE,
        max_num_seqs=64,
        max_num_batched_tokens=args.budget,
        num_threads=args.threads,
        kv_cache_memory_gb=2.0,
    )
    return EngineConfig(**{**base, **overrides})


def main() -> None:
    """Run every comparison and print its JSON lines."""
    request_reproducible_blas()  # as pool replicas run (engine.process), before any matmul
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--budget", type=int, default=1024, help="max_num_batched_tokens")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    n, out_len = (16, 64) if args.quick else (64, 128)
    n_seq, n_static = (2, 8) if args.quick else (4, 16)
    common = dict(threads=args.threads, dtype=DTYPE, seed=args.seed, quick=args.quick)
    log(
        f"threads={args.threads} requests={n} output_tokens={out_len} "
        f"hf_sequential_subset={n_seq} hf_static8_subset={n_static}"
    )

    prompts = make_prompts(n, 100, 500, args.seed)
    engine = LLMEngine(engine_config(args))
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        resolve_model_dir("default", engine.config.cache_dir), dtype=getattr(torch, DTYPE)
    ).eval()
    pad_id = engine.tokenizer.pad_token_id or 0
    run_tierserve(engine, prompts[:4], 4)  # warm-up
    ours = run_tierserve(engine, prompts, out_len)
    with torch.inference_mode():
        seq = run_hf(hf, prompts[:n_seq], 1, out_len, pad_id)
        static8 = run_hf(hf, prompts[:n_static], 8, out_len, pad_id)
    emit("engine", "throughput_tok_s.tierserve", ours, "tok/s", n=n, **common)
    emit("engine", "throughput_tok_s.hf_sequential", seq, "tok/s", n=n_seq, **common)
    emit("engine", "throughput_tok_s.hf_static8", static8, "tok/s", n=n_static, **common)
    emit("engine", "ratio.vs_hf_sequential", ours / seq, "x", **common)
    emit("engine", "ratio.vs_hf_static8", ours / static8, "x", **common)
    report_decode_profile(engine, prompts, common)

    b1_prompt = prompts[0][:128]
    ours_b1 = decode_b1_tierserve(engine, b1_prompt, out_len)
    with torch.inference_mode():
        hf_b1 = decode_b1_hf(hf, b1_prompt, out_len, pad_id)
    emit("engine", "decode_b1_tok_s.tierserve", ours_b1, "tok/s", **common)
    emit("engine", "decode_b1_tok_s.hf", hf_b1, "tok/s", **common)
    emit("engine", "ratio.decode_b1_vs_hf", ours_b1 / hf_b1, "x", **common)
    del hf, engine

    system = make_prompts(1, 1000, 1000, args.seed + 1)[0]
    shared = [system + suffix for suffix in make_prompts(17, 16, 32, args.seed + 2)]
    cold = mean_ttft_ms(LLMEngine(engine_config(args, enable_prefix_caching=False)), shared[1:])
    cached_engine = LLMEngine(engine_config(args))
    mean_ttft_ms(cached_engine, shared[:1])  # the first request fills the cache
    cached = mean_ttft_ms(cached_engine, shared[1:])
    emit("engine", "ttft_ms.prefix_cold", cold, "ms", n=16, **common)
    emit("engine", "ttft_ms.prefix_cached", cached, "ms", n=16, **common)
    emit("engine", "ratio.prefix_ttft_speedup", cold / cached, "x", **common)


if __name__ == "__main__":
    main()
