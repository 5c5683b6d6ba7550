"""Engine-load autoscaling on a local Ray cluster: a pool grows under a queue, then shrinks.

The pool runs queueing fakes (a batch of two, 20 ms a token), so a burst of
long requests leaves most of them waiting in the one replica's engine queue.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
import uuid
from collections.abc import Iterator

import pytest
import ray
from ray import serve
from ray.serve.config import AutoscalingContext
from ray.serve.handle import DeploymentHandle

from bench.paths import REPO_ROOT
from engine.config import EngineConfig
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from serving.app import _pool_options
from serving.config import AutoscalingSettings, PoolConfig
from serving.pools.pool import NewSequence, Pool
from serving.pools.scaling import EngineLoadPolicy
from testing.fakes import QueueingFakeEngine

POOL = PoolConfig(
    name="scale",
    model_name="fake",
    engine=EngineConfig(max_num_seqs=2),
    autoscaling=AutoscalingSettings(
        min_replicas=1,
        max_replicas=2,
        target_num_waiting_per_replica=1,
        target_kv_cache_usage=1.0,
        upscale_delay_s=0.5,
        downscale_delay_s=2.0,
        metrics_interval_s=0.25,
        look_back_period_s=1.0,
    ),
)
NUM_REQUESTS = 8
"""Two run, six wait: the policy wants ceil(8 / (2 + 1)) = 3 replicas, bounded to 2."""
LONG_TOKENS = 240
"""About 5 s each at 20 ms a token: the burst takes 20 s on one replica."""
SCALE_TIMEOUT_S = 60.0


def context(
    metrics: dict[str, dict[str, float]], num_queued: float = 0.0, num_replicas: int = 1
) -> AutoscalingContext:
    """What Serve's controller hands a policy: per-replica window means of the custom metrics."""
    return AutoscalingContext(
        deployment_id=None,
        deployment_name="pool-x",
        app_name="x",
        current_num_replicas=num_replicas,
        target_num_replicas=num_replicas,
        running_replicas=[],
        total_num_requests=0.0,
        total_queued_requests=num_queued,
        aggregated_metrics=metrics,
        raw_metrics=None,
        capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=8,
        policy_state={},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=0.0,
        config=None,
    )


def test_the_policy_sums_engine_load_over_replicas_and_counts_requests_held_at_handles() -> None:
    policy = EngineLoadPolicy(
        max_num_seqs=2, target_num_waiting_per_replica=1, target_kv_cache_usage=1.0
    )
    metrics = {
        "num_running": {"a": 2, "b": 2},
        "num_waiting": {"a": 3, "b": 1},
        "kv_cache_usage": {"a": 1.0, "b": 1.0},
    }
    assert policy(context(metrics, num_replicas=2)) == (3, {})  # 8 sequences, 3 per replica
    assert policy(context(metrics, num_queued=4, num_replicas=2)) == (4, {})


def test_the_policy_holds_its_replicas_until_an_engine_reports() -> None:
    policy = EngineLoadPolicy(
        max_num_seqs=2, target_num_waiting_per_replica=1, target_kv_cache_usage=1.0
    )
    assert policy(context({}, num_replicas=3)) == (3, {})


@pytest.fixture(scope="module")
def pool() -> Iterator[DeploymentHandle]:
    """The pool alone, as the app builder configures it, on a private two-CPU Ray cluster."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    path = str(REPO_ROOT)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _temp_dir=tempfile.mkdtemp(prefix="ts-ray-"),
        runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled", "PYTHONPATH": path}},
    )
    try:
        app = Pool.options(**_pool_options(POOL)).bind(POOL.engine, QueueingFakeEngine)  # type: ignore[attr-defined]
        yield serve.run(app, name=POOL.name, route_prefix=None)
    finally:
        serve.shutdown()
        ray.shutdown()


def num_running_replicas() -> int:
    deployment = serve.status().applications[POOL.name].deployments[f"pool-{POOL.name}"]
    return deployment.replica_states.get("RUNNING", 0)


async def wait_for_replicas(num_replicas: int) -> bool:
    """Poll until the pool runs `num_replicas` replicas; False after SCALE_TIMEOUT_S."""
    deadline = time.monotonic() + SCALE_TIMEOUT_S
    while time.monotonic() < deadline:
        if await asyncio.to_thread(num_running_replicas) == num_replicas:
            return True
        await asyncio.sleep(0.25)
    return False


async def generate(handle: DeploymentHandle, prompt_ids: list[int]) -> list[RequestOutput]:
    params = SamplingParams(max_tokens=LONG_TOKENS)
    request = NewSequence(uuid.uuid4().hex, prompt_ids, params, 0)
    return [out async for out in handle.options(stream=True).generate.remote(request)]


def test_a_pool_scales_up_while_requests_queue_and_back_down_after(
    pool: DeploymentHandle,
) -> None:
    async def run() -> tuple[bool, bool, list[list[RequestOutput]]]:
        burst = [asyncio.create_task(generate(pool, [i] * 8)) for i in range(NUM_REQUESTS)]
        scaled_up = await wait_for_replicas(2)
        outputs = await asyncio.gather(*burst)
        scaled_down = await wait_for_replicas(1)
        return scaled_up, scaled_down, outputs

    assert num_running_replicas() == 1
    scaled_up, scaled_down, outputs = asyncio.run(run())
    assert scaled_up, "the pool never grew while six requests waited"
    assert [len(o) for o in outputs] == [LONG_TOKENS] * NUM_REQUESTS
    assert scaled_down, "the pool never shrank back after the burst"
