"""The pools' request router on a local Ray cluster: two replicas of a pool over queueing fakes.

Placement is read from what the engines report back: a request that joins a
full batch waits (`queue_time_s`), and one that lands on the replica holding
its prompt's prefix is served from cache (`num_cached_tokens`).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import uuid
from collections.abc import Iterator

import pytest
import ray
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from bench.paths import REPO_ROOT
from engine.config import EngineConfig
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from serving.app import _pool_options
from serving.config import PoolConfig, ReplicaChoiceSettings
from serving.pools.pool import EngineFactory, NewSequence, Pool
from testing.fakes import QueueingFakeEngine, StatslessQueueingFakeEngine

BLOCK_SIZE = 4
PREFIX_LEN = 2 * BLOCK_SIZE
STATS_PERIOD_S = 0.2
NO_WAIT_S = 0.2
"""Less than one long request's run: a request that waited this long sat behind a full batch."""
LONG_TOKENS = 150
"""3 s at the queueing fake's 20 ms a token."""


def _deploy(name: str, engine_cls: EngineFactory) -> DeploymentHandle:
    """Two replicas of a pool (batch of two), with the options the app builder gives pools."""
    pool = PoolConfig(
        name=name,
        model_name="fake",
        engine=EngineConfig(max_num_seqs=2, block_size=BLOCK_SIZE),
        num_replicas=2,
        replica_choice=ReplicaChoiceSettings(
            enabled=True, stats_period_s=STATS_PERIOD_S, affinity_max_imbalance=0.5
        ),
    )
    app = Pool.options(**_pool_options(pool)).bind(pool.engine, engine_cls)  # type: ignore[attr-defined]
    return serve.run(app, name=name, route_prefix=None)


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    """A private two-CPU Ray cluster whose workers import the repo and the test fakes."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    env = {"RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(REPO_ROOT)}
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _temp_dir=tempfile.mkdtemp(prefix="ts-ray-"),
        runtime_env={"env_vars": env},
    )
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def pool(cluster: None) -> DeploymentHandle:
    return _deploy("route", QueueingFakeEngine)


@pytest.fixture(scope="module")
def statless_pool(cluster: None) -> DeploymentHandle:
    return _deploy("statless", StatslessQueueingFakeEngine)


def prompt(prefix: int, suffix: int) -> list[int]:
    """A prompt of PREFIX_LEN tokens shared by every prompt with the same `prefix`, then more."""
    return [prefix] * PREFIX_LEN + [1000 + suffix] * BLOCK_SIZE


def stream(
    handle: DeploymentHandle, prompt_ids: list[int], max_tokens: int
) -> DeploymentResponseGenerator:
    request = NewSequence(uuid.uuid4().hex, prompt_ids, SamplingParams(max_tokens=max_tokens), 0)
    return handle.options(stream=True).generate.remote(request)


async def generate(
    handle: DeploymentHandle, prompt_ids: list[int], max_tokens: int
) -> list[RequestOutput]:
    return [out async for out in stream(handle, prompt_ids, max_tokens)]


async def started(
    handle: DeploymentHandle, prompt_ids: list[int], max_tokens: int
) -> tuple[RequestOutput, asyncio.Task[list[RequestOutput]]]:
    """Send a request and wait until it runs: its first delta, and a task for the rest."""
    responses = stream(handle, prompt_ids, max_tokens)
    first = await anext(responses)
    return first, asyncio.create_task(_rest(responses))


async def _rest(responses: DeploymentResponseGenerator) -> list[RequestOutput]:
    return [out async for out in responses]


def test_requests_sharing_a_prefix_land_on_the_replica_that_holds_it(
    pool: DeploymentHandle,
) -> None:
    async def run() -> list[int]:
        cached = []
        for suffix in range(3):
            for prefix in range(1, 7):
                outputs = await generate(pool, prompt(prefix, suffix), max_tokens=2)
                cached.append(outputs[-1].num_cached_tokens)
        return cached

    cached = asyncio.run(run())
    # First sight of each prefix is a miss; every later one is a hit (random placement
    # over two replicas would miss about half of the twelve).
    assert cached[:6] == [0] * 6
    assert cached[6:] == [PREFIX_LEN] * 12


def test_requests_spread_to_the_idle_replica_when_one_is_busy(pool: DeploymentHandle) -> None:
    async def run() -> tuple[list[RequestOutput], list[RequestOutput], set[str]]:
        # Two long requests sharing a prefix fill one replica's batch of two.
        _, rest_a = await started(pool, prompt(100, 0), LONG_TOKENS)
        second, rest_b = await started(pool, prompt(100, 1), LONG_TOKENS)
        assert second.num_cached_tokens == PREFIX_LEN  # affinity: same replica
        await asyncio.sleep(3 * STATS_PERIOD_S)  # the busy replica's stats reach the router
        same_prefix = await generate(pool, prompt(100, 2), max_tokens=2)
        other_prefix = await generate(pool, prompt(200, 0), max_tokens=2)
        polled = await asyncio.gather(pool.stats.remote(), pool.stats.remote())
        for task in (rest_a, rest_b):
            task.cancel()
        return same_prefix, other_prefix, {stats.replica_id for stats in polled}

    same_prefix, other_prefix, polled_ids = asyncio.run(run())
    assert len(polled_ids) == 2  # stats polls reach the busy replica too, not only the idle one
    for outputs in (same_prefix, other_prefix):
        assert outputs[-1].queue_time_s is not None and outputs[-1].queue_time_s < NO_WAIT_S
    # The prefix's replica was full, so the prompt went where its prefix was not cached.
    assert same_prefix[-1].num_cached_tokens == 0


def test_replicas_without_stats_are_still_routed_and_share_the_load(
    statless_pool: DeploymentHandle,
) -> None:
    async def run() -> list[RequestOutput]:
        firsts, rests = [], []
        for i in range(4):  # two replicas, batches of two: four run at once when spread
            first, rest = await started(statless_pool, prompt(300 + i, 0), max_tokens=25)
            firsts.append(first)
            rests.append(rest)
        await asyncio.gather(*rests)
        return firsts

    firsts = asyncio.run(run())
    assert all(f.queue_time_s is not None and f.queue_time_s < NO_WAIT_S for f in firsts)
