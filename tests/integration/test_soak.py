"""A soak through the real Serve app and the real default-model engines (bench/traffic/soak.py):
mixed-tier requests with disconnects, aborts and fuzzed bad requests, after which nothing
hung, nothing answered a plain 500, no KV block is held and memory stayed flat.

250 requests: every action happens dozens of times, and a leak is counted exactly (a
KV block or a request left behind is non-zero at any size). The 1,000-request soak with
a replica killed midway is `python -m bench.traffic.soak --local --kill-replica`."""

from __future__ import annotations

import asyncio

from bench.traffic.soak import Outcome, SoakSettings, soak

SETTINGS = SoakSettings(duration_s=90.0, max_requests=250, max_tokens=4, settle_timeout_s=20.0)
MAX_RSS_GROWTH_MB = 200.0


def test_rough_requests_leave_nothing_behind(real_app_url: str) -> None:
    """On `real_app_url`'s app: small engines, unquantized (no first-start quantization)
    and 64 KV blocks a pool, so sixteen clients also exercise preemption."""
    report = asyncio.run(soak(real_app_url, SETTINGS))
    report.emit()
    outcomes = report.outcomes
    assert report.num_requests == SETTINGS.max_requests, "the time ran out first"
    assert outcomes[Outcome.DISCONNECTED] > 0 and outcomes[Outcome.ABORTED] > 0
    assert outcomes[Outcome.OK] > 0 and outcomes[Outcome.ERROR] > 0
    for bad in (Outcome.HUNG, Outcome.PLAIN_500, Outcome.LOST, Outcome.MALFORMED):
        assert outcomes[bad] == 0, f"{outcomes[bad]} requests {bad.value}"
    assert report.leaked_kv_usage == 0 and report.leaked_requests == 0
    assert report.rss_growth_mb < MAX_RSS_GROWTH_MB
