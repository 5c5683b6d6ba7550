"""Builds the Serve application from a TierserveConfig: one pool deployment per pool, one ingress.

`serve run configs/local.yaml` calls `app_builder` with the config file's
`args`, validated against TierserveConfig (a typo fails at deploy time).
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from policies.difficulty import DifficultyModel
from serving.app_config import TierserveConfig
from serving.batch.runner import BatchRunner
from serving.config import PoolConfig
from serving.http.ingress import Ingress
from serving.pools.pool import EngineFactory, Pool
from serving.pools.replica_choice import replica_choice_config
from serving.pools.scaling import autoscaling_config

INGRESS_MAX_ONGOING_REQUESTS = 1024
CONTROL_SLOTS = 4
INGRESS_NAME = "Ingress"


DRAIN_POLL_S = 0.2
"""How often a stopping replica looks for requests still running (Serve's default: 2 s)."""


def build_app(config: TierserveConfig, engine_cls: EngineFactory | None = None) -> Application:
    """The whole graph; `engine_cls` swaps the engine (tests pass a fake)."""
    shutdown = _shutdown_options(config)
    # Serve's decorator is not typed for classes: mypy still sees the plain class.
    pools = {
        p.name: Pool.options(**_pool_options(p), **shutdown).bind(  # type: ignore[attr-defined]
            p.engine, engine_cls, p.distill_if_missing
        )
        for p in config.pools
    }
    ingress = Ingress.options(  # type: ignore[attr-defined]
        name=INGRESS_NAME,
        num_replicas=config.ingress_num_replicas,
        ray_actor_options={"num_cpus": config.ingress_num_cpus},
        # The ingress only awaits I/O; the gateway, not Serve's queue, bounds the load.
        max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS,
        # Serve's logging config reaches the `ray.serve.*` loggers, the request log among them.
        logging_config={"log_level": config.log_level},
        **shutdown,
    )
    runner = None
    if config.batch_jobs.enabled:
        # The runner sends its lines back through the app's ingress (its front door, looked
        # up when the first line runs: the ingress holds the runner, so the graph cannot
        # hold the reverse edge). Like the ingress it only awaits I/O: no CPU to reserve.
        runner = BatchRunner.options(  # type: ignore[attr-defined]
            ray_actor_options={"num_cpus": 0, "resources": dict(config.batch_jobs.resources)},
            **shutdown,
        ).bind(config.batch_jobs, config.limits.max_json_depth)
    return ingress.bind(config, pools, runner, _difficulty_model(config))


def _shutdown_options(config: TierserveConfig) -> dict[str, float]:
    """How every deployment stops. It drains for `graceful_shutdown_timeout_s` when Serve
    stops or replaces it (Serve's own default of 20 s would cut batch-tier requests).
    Serve has no per-deployment request timeout: the ingress enforces the tiers'
    deadlines and `request_timeout_s` itself. A stopping replica looks for requests
    still running every DRAIN_POLL_S and stops at the first look that finds none
    (Serve's 2 s took each idle replica 2-3 s to stop)."""
    return {
        "graceful_shutdown_timeout_s": config.graceful_shutdown_timeout_s,
        "graceful_shutdown_wait_loop_s": DRAIN_POLL_S,
    }


def app_builder(args: dict[str, Any]) -> Application:
    """Entry point for Serve config files (`import_path: serving.app:app_builder`).

    Validated here rather than through the annotation: with postponed
    annotations Serve sees a string, not the model, and passes the raw dict.
    """
    return build_app(TierserveConfig.model_validate(args))


def _difficulty_model(config: TierserveConfig) -> DifficultyModel | None:
    """The fallback router the config names, read here (where `serve run` starts) so it
    travels with the app to the ingress, wherever that runs."""
    if config.small_model is None:
        return None
    path = config.small_model.router_file
    if not path.is_file():
        raise ValueError(
            f"small_model.router_file {str(path)!r} does not exist: train one with "
            "`tierserve router train`"
        )
    return DifficultyModel.load(path)


def _pool_options(pool: PoolConfig) -> dict[str, object]:
    """Serve deployment options of a pool: its name, replicas, resources and replica choice."""
    scaling: dict[str, object] = {"num_replicas": pool.num_replicas}
    if pool.autoscaling is not None:
        scaling = {
            "autoscaling_config": autoscaling_config(pool.autoscaling, pool.engine.max_num_seqs)
        }
    options: dict[str, object] = {
        "name": f"pool-{pool.name}",
        "ray_actor_options": {
            "num_cpus": pool.num_cpus,
            "num_gpus": pool.num_gpus,
            "resources": dict(pool.resources),
        },
        # The ingress writes one log line per request; per-call lines would mostly be stats polls.
        "logging_config": {"enable_access_log": False},
        # Admit the whole running batch plus the allowed queue, so waiting requests
        # sit in the engine's priority queue rather than Serve's FIFO one, and keep
        # slots free so stats polls never wait behind generation.
        "max_ongoing_requests": pool.engine.max_num_seqs + pool.max_queued_requests + CONTROL_SLOTS,
        **scaling,
    }
    if pool.replica_choice.enabled:
        options["request_router_config"] = replica_choice_config(pool.replica_choice, pool.engine)
    return options | _rank_bundles(pool)


def _rank_bundles(pool: PoolConfig) -> dict[str, object]:
    """For a tensor-parallel pool, one placement group per replica with a bundle per rank,
    all on one node (STRICT_PACK: the ranks are the replica's engine's own processes, as
    Ray Serve LLM reserves a model's workers); the replica itself sits in the first."""
    ranks = pool.engine.tensor_parallel_size
    if ranks == 1:
        return {}
    replica = {"CPU": pool.num_cpus, "GPU": pool.num_gpus, **pool.resources}
    rank = {"CPU": pool.num_cpus, "GPU": pool.num_gpus}
    bundles = [{k: v for k, v in b.items() if v} for b in (replica, *[rank] * (ranks - 1))]
    return {"placement_group_bundles": bundles, "placement_group_strategy": "STRICT_PACK"}
