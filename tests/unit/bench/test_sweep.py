"""The batch-size dial: measuring a cap, choosing the largest that meets the SLO, writing it."""

from __future__ import annotations

import yaml

from bench.paths import CONFIGS_DIR
from bench.serving.sweep import Point, choose, run_cap, write_config
from policies.tiers import Tier
from serving.app_config import load_config

CONFIGS = CONFIGS_DIR
TIER = Tier(name="t", ttft_ms=1000, tpot_ms=50, pool="p")


def point(cap: int, ttft: float, tpot: float, cost: float = 1.0) -> Point:
    return Point(cap, throughput_tok_s=10.0 * cap, ttft_ms_p95=ttft, tpot_ms_p50=tpot,
                 cost_per_1k_tokens=cost)  # fmt: skip


def test_choose_takes_the_largest_cap_meeting_both_targets():
    points = [point(1, 100, 20), point(4, 400, 40), point(16, 900, 49), point(64, 3000, 80)]
    chosen = choose(points, TIER)
    assert chosen is not None and chosen.max_num_seqs == 16


def test_choose_respects_the_cost_ceiling_and_says_none_when_nothing_fits():
    capped = TIER.model_copy(update={"max_cost_per_1k_tokens": 0.5})
    points = [point(1, 100, 20, cost=0.9), point(4, 400, 40, cost=0.4), point(16, 900, 49, 0.6)]
    assert choose(points, capped).max_num_seqs == 4
    assert choose([point(1, 5000, 20)], TIER) is None


def test_a_larger_cap_runs_more_at_once_on_the_real_engine(engine, tokenizer):
    prompts = [list(range(100, 140)) for _ in range(8)]
    one = run_cap(engine, prompts, cap=1, max_tokens=4, price=1.0)
    four = run_cap(engine, prompts, cap=4, max_tokens=4, price=1.0)
    assert four.throughput_tok_s > one.throughput_tok_s
    assert four.cost_per_1k_tokens < one.cost_per_1k_tokens
    assert one.ttft_ms_p95 > 0 and one.tpot_ms_p50 > 0


def test_written_config_sets_the_pools_knobs_and_still_loads(tmp_path):
    target = tmp_path / "tuned.yaml"
    write_config(CONFIGS / "local.yaml", target, "offline", point(16, 900, 49, cost=0.0123))
    tuned = load_config(target)
    assert tuned.pool("offline").engine.max_num_seqs == 16
    assert tuned.pool("offline").cost_per_1k_tokens == 0.0123
    assert yaml.safe_load(target.read_text())["applications"][0]["name"] == "tierserve"
