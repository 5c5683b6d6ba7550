"""bench_models builds what it runs: its four model folders (the MoE and its dense twin,
the default model as an AWQ and as an FP8 checkpoint) each load and generate, their steps
timed against the step-cost fit."""

from __future__ import annotations

import json

from bench.engine.bench_models import EXPERTS, build_models, cases, measure
from bench.engine.peer import Case


def test_every_model_the_benchmark_runs_loads_and_generates(tmp_path) -> None:
    folders = build_models(tmp_path, quick=True)
    assert list(folders) == ["moe", "dense", "awq", "fp8"]
    assert json.loads((folders["moe"] / "config.json").read_text())["num_local_experts"] == EXPERTS
    tiny = Case("tiny", cases(quick=True)[1].prompts[:2], max_tokens=2, batch=2)
    for folder in folders.values():
        run = measure(tiny, str(folder))
        assert run.timing.output_tokens == 4 and run.step_cost_error >= 0
    assert build_models(tmp_path, quick=True) == folders  # written once, then found


def test_the_cases_are_one_stream_and_thirty_two() -> None:
    c1, c32 = cases(quick=True)
    assert (c1.batch, len(c1.prompts), c32.batch, len(c32.prompts)) == (1, 3, 32, 32)
