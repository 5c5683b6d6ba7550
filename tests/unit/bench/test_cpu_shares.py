"""bench_sla's CPU accounting: this process counts as the client, and busy time shows."""

from __future__ import annotations

import time

from bench.serving.cpu_shares import CpuSample, sample


def test_a_busy_client_shows_about_one_core() -> None:
    before = sample()
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        pass
    shares = sample().shares_since(before)
    assert 0.5 < shares["client"] <= 1.1


def test_shares_are_cpu_seconds_over_the_interval_by_kind() -> None:
    earlier = CpuSample(10.0, {"engine.pool-offline": 5.0, "client": 1.0})
    later = CpuSample(12.0, {"engine.pool-offline": 7.0, "client": 1.5, "ray::ProxyActor": 0.2})
    assert later.shares_since(earlier) == {
        "client": 0.25, "engine.pool-offline": 1.0, "ray::ProxyActor": 0.1,
    }  # fmt: skip
