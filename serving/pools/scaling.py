"""The pools' autoscaling policy: Serve's `AutoscalingConfig(policy=...)` hook on engine load.

Thin glue over policies/scaling.py. Serve's controller builds one
EngineLoadPolicy per pool from its `policy_kwargs` and calls it every control
loop tick with the replicas' `record_autoscaling_stats` values, each averaged
over the look-back window; Serve then applies the delays and the bounds.
"""

from __future__ import annotations

from typing import Any

from ray.serve.config import AutoscalingConfig, AutoscalingContext, AutoscalingPolicy

from policies.scaling import PoolDemand, ScalingTargets, desired_num_replicas
from serving.config import AutoscalingSettings


def autoscaling_config(settings: AutoscalingSettings, max_num_seqs: int) -> AutoscalingConfig:
    """The Serve option that scales a pool with EngineLoadPolicy under `settings`."""
    policy = AutoscalingPolicy(
        policy_function=EngineLoadPolicy,
        policy_kwargs={
            "max_num_seqs": max_num_seqs,
            "target_num_waiting_per_replica": settings.target_num_waiting_per_replica,
            "target_kv_cache_usage": settings.target_kv_cache_usage,
        },
    )
    return AutoscalingConfig(
        min_replicas=settings.min_replicas,
        max_replicas=settings.max_replicas,
        upscale_delay_s=settings.upscale_delay_s,
        downscale_delay_s=settings.downscale_delay_s,
        metrics_interval_s=settings.metrics_interval_s,
        look_back_period_s=settings.look_back_period_s,
        policy=policy,
    )


class EngineLoadPolicy:
    """Sizes a pool by its engines' queues and KV use (policies.scaling.desired_num_replicas)."""

    def __init__(
        self, max_num_seqs: int, target_num_waiting_per_replica: float, target_kv_cache_usage: float
    ) -> None:
        self._targets = ScalingTargets(
            max_num_seqs, target_num_waiting_per_replica, target_kv_cache_usage
        )

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
        """The replica count the pool should have now; holds still until an engine reports."""
        metrics = ctx.aggregated_metrics
        if not metrics:
            return ctx.target_num_replicas, {}
        demand = PoolDemand(
            num_running=sum(metrics.get("num_running", {}).values()),
            # Requests the handles hold back (every replica at max_ongoing_requests) wait too.
            num_waiting=sum(metrics.get("num_waiting", {}).values())
            + (ctx.total_queued_requests or 0.0),
            kv_cache_usage=sum(metrics.get("kv_cache_usage", {}).values()),
        )
        num_replicas = desired_num_replicas(
            demand,
            self._targets,
            ctx.capacity_adjusted_min_replicas,
            ctx.capacity_adjusted_max_replicas,
        )
        return num_replicas, {}
