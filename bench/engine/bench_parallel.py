"""Tensor parallelism on this machine's cores: TP=2 against TP=1 on the same cores, in one run.

  python -m bench.engine.bench_parallel [--quick]

bench_peer's engine workload (random-token prompts, greedy, EOS ignored, the
engine's `auto` dtype, prefix cache off):

- c64: 64 requests of 60-token prompts -> 128 tokens (64 with --quick), all at once;
- c1: one request of 128 -> 128 (64), three in a row.

TP=1 steps on 2 torch threads; TP=2 on 1 thread per rank (rank 0 in this
process, rank 1 a worker process). `ratio.tp2_vs_tp1.<case>` is TP=2's
output tok/s over TP=1's. `share.tp2.allreduce.c64`: the part of rank 0's
c64 decode steps spent in the ranks' sums (waiting for the other rank
included: its slice is smaller where the KV heads do not divide evenly).
Pipeline parallelism is not built (issue 32), so nothing is printed for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from bench.engine.bench_engine import make_prompts
from bench.engine.peer import Case, case_params, peer_parser, run_tierserve
from bench.report import emit, log
from engine.config import EngineConfig, auto_dtype_name
from engine.engine import LLMEngine
from engine.model.batch_invariance import request_reproducible_blas
from engine.parallel.shard import RowParallel

BENCH = "parallel"
DTYPE = auto_dtype_name()
CORES = 2


def cases(quick: bool) -> list[Case]:
    """bench_peer's c64 and c1; --quick halves the outputs."""
    out = 64 if quick else 128
    return [
        Case("c64", make_prompts(64, 60, 60, seed=1), out, batch=64),
        Case("c1", make_prompts(3, 128, 128, seed=2), out, batch=1),
    ]


def engine_config(tensor_parallel_size: int) -> EngineConfig:
    """The same engine at TP=1 on both cores' threads or TP=2 on a thread per rank."""
    return EngineConfig(
        dtype=DTYPE,
        max_num_seqs=64,
        max_num_batched_tokens=1024,
        kv_cache_memory_gb=1.0,
        enable_prefix_caching=False,
        tensor_parallel_size=tensor_parallel_size,
        num_threads=CORES // tensor_parallel_size,
    )


class SumClock:
    """Seconds rank 0 spends in the ranks' sums, wrapped around each RowParallel's."""

    def __init__(self, engine: LLMEngine) -> None:
        self.seconds = 0.0
        for module in engine.model.modules():
            if isinstance(module, RowParallel):
                module.all_reduce = self._timed(module.all_reduce)

    def _timed(self, all_reduce: Callable[[torch.Tensor], None]) -> Callable:
        def timed(tensor: torch.Tensor) -> None:
            start = time.perf_counter()
            all_reduce(tensor)
            self.seconds += time.perf_counter() - start

        return timed


def allreduce_share(engine: LLMEngine, case: Case) -> float:
    """The share of the case's decode steps spent in the sums (its prefill left out)."""
    clock = SumClock(engine)
    params = case_params(case)
    for i, prompt in enumerate(case.prompts):
        engine.add_request(f"share-{i}", prompt, params)
    while any(r.request.num_output_tokens == 0 for r in engine.requests.values()):
        engine.step()
    clock.seconds, start = 0.0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return clock.seconds / (time.perf_counter() - start)


def measure(tensor_parallel_size: int, workloads: list[Case]) -> tuple[dict[str, float], float]:
    """tok/s of each case, and (at TP > 1) the sums' share of c64's decode steps."""
    config = engine_config(tensor_parallel_size)
    torch.set_num_threads(config.num_threads or CORES)
    engine = LLMEngine(config)
    try:
        rates = {case.name: run_tierserve(engine, case).tok_s for case in workloads}
        share = allreduce_share(engine, workloads[0]) if tensor_parallel_size > 1 else 0.0
    finally:
        engine.close()
    return rates, share


def main() -> None:
    """TP=1, then TP=2, on the same cases; one ratio per case and the sums' share."""
    request_reproducible_blas()  # as pool replicas run (engine.process), before any matmul
    cli = peer_parser(__doc__).parse_args()
    workloads = cases(cli.quick)
    common = dict(dtype=DTYPE, cores=CORES, quick=cli.quick)
    tp1, _ = measure(1, workloads)
    tp2, share = measure(2, workloads)
    for case in workloads:
        for size, rates in ((1, tp1), (2, tp2)):
            rate = rates[case.name]
            emit(BENCH, f"throughput_tok_s.tp{size}.{case.name}", rate, "tok/s", **common)
        ratio = tp2[case.name] / tp1[case.name]
        emit(BENCH, f"ratio.tp2_vs_tp1.{case.name}", ratio, "x", target=1.0, **common)
    emit(BENCH, "share.tp2.allreduce.c64", share, "share", target=0.10, **common)
    log("pipeline parallelism is not built: no pp2_vs_pp1 figure")


if __name__ == "__main__":
    main()
