"""A soak through the real Serve app and the real default-model engines (bench/traffic/soak.py):
mixed-tier requests with disconnects, aborts and fuzzed bad requests, after which nothing
hung, nothing answered a plain 500, no KV block is held and memory stayed flat.

250 requests: every action happens dozens of times, and a leak is counted exactly (a
KV block or a request left behind is non-zero at any size). The 1,000-request soak with
a replica killed midway is `python -m bench.traffic.soak --local --kill-replica`."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from bench.traffic.soak import Outcome, SoakSettings, soak
from serving.app_config import TierserveConfig, load_config
from testing.serve_harness import serving

SETTINGS = SoakSettings(duration_s=90.0, max_requests=250, max_tokens=4, settle_timeout_s=20.0)
MAX_RSS_GROWTH_MB = 200.0


def _config() -> TierserveConfig:
    """configs/local.yaml with small engines: unquantized (no first-start quantization)
    and 64 KV blocks a pool, so sixteen clients also exercise preemption."""
    base = load_config("configs/local.yaml")
    small = {"num_kv_blocks": 64, "max_model_len": 1024, "quant": None}
    pools = tuple(
        pool.model_copy(update={"engine": replace(pool.engine, **small)}) for pool in base.pools
    )
    return base.model_copy(update={"pools": pools, "stats_poll_interval_s": 0.1})


def test_rough_requests_leave_nothing_behind() -> None:
    with serving(_config()) as base_url:
        report = asyncio.run(soak(base_url, SETTINGS))
    report.emit()
    outcomes = report.outcomes
    assert report.num_requests == SETTINGS.max_requests, "the time ran out first"
    assert outcomes[Outcome.DISCONNECTED] > 0 and outcomes[Outcome.ABORTED] > 0
    assert outcomes[Outcome.OK] > 0 and outcomes[Outcome.ERROR] > 0
    for bad in (Outcome.HUNG, Outcome.PLAIN_500, Outcome.LOST, Outcome.MALFORMED):
        assert outcomes[bad] == 0, f"{outcomes[bad]} requests {bad.value}"
    assert report.leaked_kv_usage == 0 and report.leaked_requests == 0
    assert report.rss_growth_mb < MAX_RSS_GROWTH_MB
