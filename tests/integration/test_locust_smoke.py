"""bench/traffic/run_locust.py end to end: a few seconds of locust against the app on a private Ray
cluster with the fake engine (no model), then its files, per-tier successes and TTFTs.

The load runs once per module, in a subprocess: locust patches the standard
library with gevent and must never be imported into the test process.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.paths import REPO_ROOT

TIERS = ("interactive", "standard", "batch")
LOAD_S = 6


@dataclass(frozen=True)
class LocustRun:
    """What one run left behind: its output folder and its JSON lines by metric."""

    out: Path
    headlines: dict[str, float]

    def stats(self) -> dict[tuple[str, str], dict[str, str]]:
        """Locust's final stats by (request type, name)."""
        with (self.out / "locust_stats.csv").open(newline="") as file:
            return {(row["Type"], row["Name"]): row for row in csv.DictReader(file)}


@pytest.fixture(scope="module")
def locust_run(tmp_path_factory: pytest.TempPathFactory) -> LocustRun:
    out = tmp_path_factory.mktemp("locust")
    command = [
        sys.executable, "-m", "bench.traffic.run_locust", "--local", "--fake-engine",
        "--users", "4", "--spawn-rate", "4", "--duration", str(LOAD_S), "--out", str(out),
    ]  # fmt: skip
    result = subprocess.run(
        command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=240,
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert {r["bench"] for r in records} == {"locust"}
    return LocustRun(out, {r["metric"]: r["value"] for r in records})


def test_writes_csv_html_report_and_plots(locust_run: LocustRun) -> None:
    for name in ("locust_stats.csv", "locust_stats_history.csv", "locust_report.html"):
        assert (locust_run.out / name).stat().st_size > 0, name
    for name in ("latency_vs_throughput.png", "goodput.png"):
        assert (locust_run.out / name).read_bytes().startswith(b"\x89PNG"), name


def test_every_tier_completes_streams(locust_run: LocustRun) -> None:
    stats = locust_run.stats()
    for tier in TIERS:
        assert int(stats[("E2E", tier)]["Request Count"]) >= 1, tier
        assert locust_run.headlines[f"requests.{tier}"] >= 1


def test_failures_are_only_sheds(locust_run: LocustRun) -> None:
    """Malformed requests would show up as 4xx/5xx here; a 429 is admission doing its job."""
    with (locust_run.out / "locust_failures.csv").open(newline="") as file:
        errors = [row["Error"] for row in csv.DictReader(file)]
    assert all("429" in error for error in errors), errors


def test_ttft_is_recorded_for_every_completed_stream(locust_run: LocustRun) -> None:
    stats = locust_run.stats()
    for tier in TIERS:
        assert stats[("TTFT", tier)]["Request Count"] == stats[("E2E", tier)]["Request Count"]
        ttft_ms, e2e_ms = (locust_run.headlines[f"{m}_ms.p50.{tier}"] for m in ("ttft", "e2e"))
        assert 0 < ttft_ms <= e2e_ms


def test_goodput_and_attainment_are_reported_per_tier(locust_run: LocustRun) -> None:
    for tier in TIERS:
        goodput = locust_run.headlines[f"goodput_rps.{tier}"]
        assert 0 <= goodput <= locust_run.headlines[f"throughput_rps.{tier}"]
        assert 0 <= locust_run.headlines[f"slo_attainment.{tier}"] <= 1
    # The fake engine is far inside batch's 60 s / 500 ms targets, however busy the machine.
    assert locust_run.headlines["slo_attainment.batch"] == 1
