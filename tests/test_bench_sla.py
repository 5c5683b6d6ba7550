"""load/bench_sla.py builds what it deploys: every config, app and ingress model routing it
hands to Serve, without a cluster or a model, so the benchmark cannot break unseen again
(its shared-pool copy once kept a small model whose pool it had dropped)."""

from __future__ import annotations

from pathlib import Path

import pytest
from ray.serve import Application

from app.builder import build_app
from app.config import TierserveConfig, load_config
from deployments.ingress import model_routes
from load.bench_sla import FULL, QUICK, SHARED_MAX_NUM_SEQS, deployments, parse_args

FACTOR = 2.5


@pytest.fixture(scope="module")
def configured() -> TierserveConfig:
    return load_config(parse_args([]).config)


@pytest.fixture(scope="module")
def built(configured: TierserveConfig) -> dict[str, TierserveConfig]:
    return deployments(configured, FACTOR)


def test_arguments_default_to_the_local_config_and_the_full_plan() -> None:
    args = parse_args([])
    assert args.config == Path("configs/local.yaml") and not args.quick
    quick = parse_args(["--quick", "--out", "results"])
    assert quick.quick and quick.out == Path("results")
    assert QUICK.concurrency < FULL.concurrency


@pytest.mark.parametrize("name", ["tierserve", "shared pool"])
def test_each_deployment_builds_as_serve_will_start_it(
    built: dict[str, TierserveConfig], name: str
) -> None:
    config = built[name]
    # What the ingress replica's constructor reads first: it died here on main.
    routes = model_routes(config)
    assert all(config.pool(pool) for pool in {t.pool for t in config.tiers})
    assert routes.small_pool is None or config.pool(routes.small_pool)
    TierserveConfig.model_validate(dict(config))
    assert isinstance(build_app(config), Application)


def test_slos_are_scaled_the_same_on_both_deployments(
    configured: TierserveConfig, built: dict[str, TierserveConfig]
) -> None:
    for config in built.values():
        for tier in config.tiers:
            assert tier.ttft_ms == configured.tier(tier.name).ttft_ms * FACTOR
            assert tier.tpot_ms == configured.tier(tier.name).tpot_ms * FACTOR


def test_the_shared_deployment_is_one_pool_first_come_first_served(
    configured: TierserveConfig, built: dict[str, TierserveConfig]
) -> None:
    shared = built["shared pool"]
    (pool,) = shared.pools
    assert pool.engine.max_num_seqs == SHARED_MAX_NUM_SEQS and pool.engine.spec_decode is None
    assert shared.small_model is None
    assert {(t.pool, t.overflow_pool, t.priority) for t in shared.tiers} == {("shared", None, 0)}
    assert built["tierserve"].pools == configured.pools
