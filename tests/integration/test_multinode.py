"""Beyond one machine: each pool on its own node of a multi-node Ray cluster, surviving a node loss.

`ray.cluster_utils.Cluster` starts a head and two worker nodes in this
process's sandbox; the workers carry the custom resources `pool_interactive`
and `pool_offline`, and each pool asks for its own, as pools on a KubeRay
cluster ask for their worker group's. The app runs the fake engine, so the
test is about placement and failover, not the model.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import ray
from ray import serve
from ray.cluster_utils import Cluster

from bench.paths import REPO_ROOT
from serving.app import build_app
from serving.app_config import TierserveConfig
from testing.fakes import FakeEngine
from testing.local_cluster import free_port
from testing.serve_harness import fake_config

POOLS = ("interactive", "offline")
WAIT_S = 120


def multinode_config() -> TierserveConfig:
    """The fake-engine config with each of POOLS bound to its node's custom resource (the
    small pool, routed to by model rather than tier, runs anywhere)."""
    base = fake_config()
    pools = tuple(
        p.model_copy(update={"resources": {f"pool_{p.name}": 1.0}, "autoscaling": None})
        if p.name in POOLS
        else p
        for p in base.pools
    )
    return base.model_copy(update={"pools": pools})


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Cluster, str, dict[str, str]]]:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    path = str(REPO_ROOT)
    env = {"RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    # Cluster.add_node writes the address file under Ray's default temp folder whatever the
    # node's temp_dir, and fails on a machine where no Ray ever made that folder.
    Path(tempfile.gettempdir(), "ray").mkdir(exist_ok=True)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "include_dashboard": False,
            "temp_dir": tempfile.mkdtemp(prefix="ts-mn-"),
        },
    )
    nodes = {pool: cluster.add_node(num_cpus=1, resources={f"pool_{pool}": 1}) for pool in POOLS}
    ray.init(address=cluster.address, runtime_env={"env_vars": env})
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(multinode_config(), FakeEngine), name="tierserve", blocking=False)
        base_url = f"http://127.0.0.1:{port}"
        _wait(lambda: _status(base_url, "/health") == 200, "app healthy")
        yield cluster, base_url, {pool: node.node_id for pool, node in nodes.items()}
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def test_each_pool_runs_on_the_node_carrying_its_resource(cluster):
    ray_cluster, _, node_ids = cluster
    for pool in POOLS:
        assert _replica_nodes(ray_cluster, pool) == {node_ids[pool]}, pool


def test_losing_a_node_leaves_the_other_pool_serving_and_the_lost_one_comes_back(cluster):
    ray_cluster, base_url, node_ids = cluster
    offline_node = next(n for n in ray_cluster.worker_nodes if n.node_id == node_ids["offline"])
    ray_cluster.remove_node(offline_node)
    # The ingress may have run on the lost node; restart it in any case, so that a new
    # ingress has to come up while the offline pool has nowhere to run.
    _kill_live_actors(ray_cluster, "#Ingress#")
    _wait(lambda: _chat(base_url, "interactive") == 200, "interactive served after the loss")
    assert _replica_nodes(ray_cluster, "interactive") == {node_ids["interactive"]}
    assert _chat(base_url, "batch") == 503  # its only pool is down: a prompt, clear refusal
    ray_cluster.add_node(num_cpus=1, resources={"pool_offline": 1})
    _wait(lambda: _chat(base_url, "batch") == 200, "batch tier served after the node came back")


def _live_actors(ray_cluster: Cluster, name_part: str) -> list[dict]:
    actors = ray_cluster.global_state.actor_table(None, actor_state_name="ALIVE").values()
    return [a for a in actors if name_part in a["Name"]]


def _kill_live_actors(ray_cluster: Cluster, name_part: str) -> None:
    for actor in _live_actors(ray_cluster, name_part):
        ray.kill(ray.get_actor(actor["Name"], namespace="serve"), no_restart=True)


def _replica_nodes(ray_cluster: Cluster, pool: str) -> set[str]:
    """Nodes running a live replica of `pool`, from the GCS actor table."""
    return {a["Address"]["NodeID"] for a in _live_actors(ray_cluster, f"#pool-{pool}#")}


def _chat(base_url: str, tier: str) -> int:
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
    }
    try:
        response = httpx.post(
            f"{base_url}/v1/chat/completions", json=body, headers={"X-SLA-Tier": tier}, timeout=30
        )
    except httpx.HTTPError:
        return 0
    return response.status_code


def _status(base_url: str, path: str) -> int:
    try:
        return httpx.get(f"{base_url}{path}", timeout=5).status_code
    except httpx.HTTPError:
        return 0


def _wait(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for: {what}"
        time.sleep(0.5)
