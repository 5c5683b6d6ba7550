"""Co-location arbitration: an interactive engine beside an offline one on the same cores.

  python -m bench.serving.bench_colocation [--quick] [--config configs/local.yaml]

Each engine steps in a process of its own, as a pool's engine child does,
started at Ray's worker niceness (15, in one session, as Ray starts them),
beside a process standing for Serve's own work (ingress, proxy, replicas: one
more nice-15 process in that session, busy SERVING_DUTY of a core): without
it two one-thread engines on two cores barely meet, and nothing arbitrates.
The interactive engine decodes batches of INTERACTIVE_BATCH requests; the
offline engine keeps OFFLINE_IN_FLIGHT sequences live. Scenarios: each alone,
and both with the interactive engine at the `cpu_priority` it inherits and at
`urgent`, the offline one in Ray's session or in a group of its own
(`own_group`; engine.process.apply_cpu_priority).

Reported: the interactive TPOT beside the offline engine over alone (p50, p95;
1.0 is no interference), and the offline throughput beside it over alone.
Speculative decoding is off and step-cost calibration skipped: the step time
is what is measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import random
import time
from dataclasses import dataclass
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

from bench.prompts import chat_turn
from bench.report import emit, log, percentile
from engine.config import EngineConfig
from serving.app_config import load_config

BENCH = "colocation"
RAY_WORKER_NICE = 15
INTERACTIVE_BATCH = 2
OFFLINE_IN_FLIGHT = 48
PROMPT_TOKENS = 128
OUTPUT_TOKENS = 64
SERVING_DUTY = 0.5
"""Share of a core the stand-in for Serve's processes keeps busy (in 5 ms bursts)."""


@dataclass(frozen=True)
class Scenario:
    """Which engines run, at which `cpu_priority` (None: not running)."""

    name: str
    interactive: str | None
    offline: str | None


SCENARIOS = (
    Scenario("interactive_alone", "inherit", None),
    Scenario("offline_alone", None, "inherit"),
    Scenario("both", "inherit", "inherit"),
    Scenario("both_urgent", "urgent", "inherit"),
    Scenario("both_urgent_offline_own_group", "urgent", "own_group"),
)


def engine_config(config_path: Path, pool: str) -> EngineConfig:
    """The pool's engine as configured, without speculation or calibration, in this process."""
    engine = load_config(config_path).pool(pool).engine
    return dataclasses.replace(
        engine, spec_decode=None, calibrate_step_cost=False, separate_process=False,
        cpu_priority="inherit",
    )  # fmt: skip


def _engine_main(
    role: str, config: EngineConfig, priority: str, barrier: Barrier, seconds: float, results: Any
) -> None:
    """One engine's process: the pool's priority, the engine, then its workload."""
    from engine.engine import LLMEngine
    from engine.process import apply_cpu_priority, configure_process

    apply_cpu_priority(priority)
    configure_process(config)
    engine = LLMEngine(config)
    run = _interactive if role == "interactive" else _offline
    results.put((role, run(engine, barrier, seconds)))


def _prompt(engine: Any, rng: random.Random) -> list[int]:
    from engine.model.chat import chat_prompt_ids

    return chat_prompt_ids(engine.tokenizer, chat_turn(PROMPT_TOKENS, rng))


def _params() -> Any:
    from engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0, ignore_eos=True)


def _interactive(engine: Any, barrier: Barrier, seconds: float) -> list[float]:
    """Batches of INTERACTIVE_BATCH requests until the time is up; each request's TPOT (s)."""
    rng, tpots = random.Random(0), []
    _decode_batch(engine, rng)  # warm
    barrier.wait()
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        tpots += _decode_batch(engine, rng)
    return tpots


def _decode_batch(engine: Any, rng: random.Random) -> list[float]:
    """Run one batch to the end; the TPOT of each of its requests."""
    for i in range(INTERACTIVE_BATCH):
        engine.add_request(f"i{time.perf_counter_ns()}-{i}", _prompt(engine, rng), _params())
    token_times: dict[str, list[float]] = {}
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            token_times.setdefault(output.request_id, []).append(now)
    return [(t[-1] - t[0]) / (len(t) - 1) for t in token_times.values() if len(t) > 1]


def _offline(engine: Any, barrier: Barrier, seconds: float) -> float:
    """OFFLINE_IN_FLIGHT sequences kept live until the time is up; output tokens per second."""
    rng = random.Random(1)
    prompts = [_prompt(engine, rng) for _ in range(8)]
    barrier.wait()
    start = time.perf_counter()
    num_tokens, next_id = 0, 0
    while time.perf_counter() - start < seconds:
        while len(engine.requests) < OFFLINE_IN_FLIGHT:
            engine.add_request(f"o{next_id}", prompts[next_id % len(prompts)], _params())
            next_id += 1
        num_tokens += sum(len(o.new_token_ids) for o in engine.step())
    return num_tokens / (time.perf_counter() - start)


def _serving_stand_in(barrier: Barrier, seconds: float) -> None:
    """Busy SERVING_DUTY of the time in 5 ms bursts, at the niceness it was started with."""
    barrier.wait()
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        burst_end = time.perf_counter() + 0.005
        while time.perf_counter() < burst_end:
            pass
        time.sleep(0.005 * (1 - SERVING_DUTY) / SERVING_DUTY)


def run_scenario(scenario: Scenario, configs: dict[str, EngineConfig], seconds: float) -> dict:
    """Start the scenario's processes, time them together; {role: result}."""
    context = multiprocessing.get_context("spawn")
    roles = [r for r in ("interactive", "offline") if getattr(scenario, r)]
    barrier = context.Barrier(len(roles) + 1)
    results = context.Queue()
    processes = [
        context.Process(
            target=_engine_main,
            args=(
                role,
                configs[role],
                getattr(scenario, role),
                barrier,
                seconds,
                results,
            ),
        )  # fmt: skip
        for role in roles
    ]
    processes.append(context.Process(target=_serving_stand_in, args=(barrier, seconds)))
    for process in processes:
        process.start()
    measured = dict(results.get(timeout=900) for _ in roles)
    for process in processes:
        process.join()
    return measured


def report(results: dict[str, dict]) -> None:
    """TPOT ratios (beside over alone) and offline throughput ratios."""
    alone = results["interactive_alone"]["interactive"]
    base = results["offline_alone"]["offline"]
    for q in (50, 95):
        emit(BENCH, f"tpot_ms.p{q}.interactive_alone", percentile(alone, q) * 1000, "ms")
    emit(BENCH, "throughput_tok_s.offline_alone", base, "tok/s")
    for name, measured in results.items():
        if "interactive" in measured and name != "interactive_alone":
            for q in (50, 95):
                beside = percentile(measured["interactive"], q)
                emit(BENCH, f"tpot_ms.p{q}.interactive.{name}", beside * 1000, "ms")
                emit(BENCH, f"ratio.interactive_tpot.p{q}.{name}_vs_alone",
                     beside / percentile(alone, q), "x")  # fmt: skip
        if "offline" in measured and name != "offline_alone":
            value = measured["offline"]
            emit(BENCH, f"throughput_tok_s.offline.{name}", value, "tok/s")
            emit(BENCH, f"ratio.offline_throughput.{name}_vs_alone", value / base, "x")


def main() -> None:
    """Run every scenario at Ray's worker niceness, one after the other, and report."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--config", type=Path, default=Path("configs/local.yaml"))
    args = parser.parse_args()
    os.nice(RAY_WORKER_NICE - os.nice(0))  # the processes below start as Ray's workers do
    configs = {pool: engine_config(args.config, pool) for pool in ("interactive", "offline")}
    seconds = 20.0 if args.quick else 30.0
    results = {}
    for scenario in SCENARIOS:
        log(f"--- {scenario.name}")
        results[scenario.name] = run_scenario(scenario, configs, seconds)
    report(results)


if __name__ == "__main__":
    main()
