"""bench/serving/bench_colocation.py builds what it runs: each pool's engine config from the
local config, every scenario's priorities valid for an engine child, and a report from
measured results, without starting an engine."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from bench.serving.bench_colocation import SCENARIOS, engine_config, report
from engine.config import CPU_PRIORITIES

LOCAL = Path("configs/local.yaml")


@pytest.mark.parametrize("pool", ["interactive", "offline"])
def test_each_engine_is_the_pools_own_in_this_process(pool: str) -> None:
    config = engine_config(LOCAL, pool)
    assert config.spec_decode is None and not config.calibrate_step_cost
    assert not config.separate_process and config.cpu_priority == "inherit"


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_every_scenarios_priority_is_one_an_engine_child_takes(scenario) -> None:
    config = engine_config(LOCAL, "offline")
    for priority in (scenario.interactive, scenario.offline):
        if priority is not None:
            assert priority in CPU_PRIORITIES
            dataclasses.replace(config, separate_process=True, cpu_priority=priority)


def test_the_report_reads_every_scenarios_results(capsys) -> None:
    results = {
        s.name: {
            **({"interactive": [0.05, 0.06, 0.07]} if s.interactive else {}),
            **({"offline": 100.0} if s.offline else {}),
        }
        for s in SCENARIOS
    }
    report(results)
    captured = capsys.readouterr()
    printed = captured.out + captured.err
    for scenario in SCENARIOS[2:]:
        assert f"ratio.offline_throughput.{scenario.name}_vs_alone" in printed
