"""bench_sla's CPU accounting: this process counts as the client, and busy time shows."""

from __future__ import annotations

import time

import pytest

from bench.serving.cpu_shares import CpuSample, sample


def test_a_busy_client_shows_the_cpu_it_used() -> None:
    """Spun until this process has used 0.3 s of CPU, however busy the machine (other
    processes taking a share would make a wall-clock spin show less than a core)."""
    before, cpu_before_s = sample(), time.process_time()
    while time.process_time() - cpu_before_s < 0.3:
        pass
    after, used_s = sample(), time.process_time() - cpu_before_s
    client_s = after.shares_since(before)["client"] * (after.at_s - before.at_s)
    assert client_s == pytest.approx(used_s, abs=0.05)


def test_shares_are_cpu_seconds_over_the_interval_by_kind() -> None:
    earlier = CpuSample(10.0, {"engine.pool-offline": 5.0, "client": 1.0})
    later = CpuSample(12.0, {"engine.pool-offline": 7.0, "client": 1.5, "ray::ProxyActor": 0.2})
    assert later.shares_since(earlier) == {
        "client": 0.25, "engine.pool-offline": 1.0, "ray::ProxyActor": 0.1,
    }  # fmt: skip
