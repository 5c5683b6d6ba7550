"""What batch invariance costs, and what it buys.

    python -m bench.engine.bench_invariance [--quick]

Two engines on the default model in one process, `batch_invariant` on and
off, run the same random-token workloads (which neither the prefix cache nor
prompt lookup helps), alternating so machine noise hits both alike:

- decode at batch 1 and 8 (short prompts, `ignore_eos`), where invariance pads
  matmuls of fewer rows than the probed count;
- prefill of a 512- and a 1,500-token prompt, where invariance moves attention
  from SDPA to the paged kernel.

Then what it buys: one seeded sampling request run cold, warm (prefix cached)
and beside other requests, on each engine; `reproducible.*` is 1 when all its
runs returned the same token ids and log-probabilities.

JSON lines: `ratio.invariant_vs_off.<workload>` (time with invariance over
time without; above 1 is the cost), `reproducible.invariant`,
`reproducible.off`.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from bench.report import emit, log
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.model.batch_invariance import request_reproducible_blas
from engine.sampling_params import SamplingParams
from testing.engine_helpers import run_requests

WORKLOADS = {  # name: (requests, prompt tokens, output tokens)
    "decode_b1": (1, 16, 64),
    "decode_b8": (8, 16, 64),
    "prefill_512": (1, 512, 1),
    "prefill_1500": (1, 1500, 1),
}
SEEDED = SamplingParams(max_tokens=32, temperature=0.9, seed=1234, logprobs=5)


def random_prompt(rng: random.Random, num_tokens: int) -> list[int]:
    """Token ids drawn uniformly from the ordinary vocabulary: no repeats to exploit."""
    return [rng.randrange(100, 40_000) for _ in range(num_tokens)]


def timed_run(engine: LLMEngine, workload: tuple[int, int, int], rng: random.Random) -> float:
    """Seconds to run one workload to completion on `engine`."""
    num_requests, prompt_len, max_tokens = workload
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    requests = {f"r{i}": (random_prompt(rng, prompt_len), params) for i in range(num_requests)}
    start = time.perf_counter()
    run_requests(engine, requests)
    return time.perf_counter() - start


def reproducible(engine: LLMEngine, rng: random.Random) -> bool:
    """The seeded request cold, warm and in a busy batch: identical every time?"""
    prompt = random_prompt(rng, 200)
    runs = [run_requests(engine, {"seeded": (prompt, SEEDED)})["seeded"] for _ in range(2)]
    others = {
        f"other{i}": (random_prompt(rng, 30 + 40 * i), SamplingParams(max_tokens=16))
        for i in range(5)
    }
    runs.append(run_requests(engine, {**others, "seeded": (prompt, SEEDED)})["seeded"])
    return all((r.token_ids, r.logprobs) == (runs[0].token_ids, runs[0].logprobs) for r in runs)


def main() -> None:
    """Time each workload on both engines, then check reproducibility on both."""
    request_reproducible_blas()  # as pool replicas run (engine.process), before any matmul
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="one repetition instead of three")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base = dict(model="default", max_num_seqs=16, max_num_batched_tokens=512, num_kv_blocks=512)
    engines = {
        on: LLMEngine(EngineConfig(**base, batch_invariant=on, enable_prefix_caching=False))
        for on in (True, False)
    }
    log(f"threads={args.threads} invariance active: {engines[True].runner.batch_invariant}")
    repetitions = 1 if args.quick else 3
    common = dict(threads=args.threads, repetitions=repetitions, quick=args.quick)
    for name, workload in WORKLOADS.items():
        best = {on: float("inf") for on in engines}
        for repetition in range(repetitions + 1):  # the first round warms up
            for on, engine in engines.items():
                seconds = timed_run(engine, workload, random.Random(repetition))
                best[on] = min(best[on], seconds) if repetition else best[on]
        ratio = best[True] / best[False]
        emit("invariance", f"ratio.invariant_vs_off.{name}", ratio, "x", **common)
    del engines
    for on in (True, False):  # with the prefix cache this time: the warm run must hit it
        engine = LLMEngine(EngineConfig(**base, batch_invariant=on))
        same = reproducible(engine, random.Random(7))
        emit("invariance", f"reproducible.{'invariant' if on else 'off'}", same, "bool", **common)


if __name__ == "__main__":
    main()
