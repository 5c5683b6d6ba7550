"""Pool sizing from engine queues and KV use: up under queueing or KV pressure, down when idle."""

from __future__ import annotations

from policies.scaling import PoolDemand, ScalingTargets, desired_num_replicas

TARGETS = ScalingTargets(
    max_num_seqs=4, target_num_waiting_per_replica=2, target_kv_cache_usage=0.8
)


def desired(running: float, waiting: float = 0, kv: float = 0, lo: int = 1, hi: int = 8) -> int:
    return desired_num_replicas(PoolDemand(running, waiting, kv), TARGETS, lo, hi)


def test_an_idle_pool_shrinks_to_its_minimum() -> None:
    assert desired(0) == 1
    assert desired(0, lo=2) == 2


def test_full_batches_within_the_queue_target_need_no_more_replicas() -> None:
    assert desired(running=8, waiting=4) == 2  # two replicas: 4 running + 2 waiting each


def test_queueing_beyond_the_target_adds_replicas() -> None:
    assert desired(running=8, waiting=5) == 3
    assert desired(running=4, waiting=20) == 4


def test_kv_pressure_adds_replicas_even_without_a_queue() -> None:
    assert desired(running=4, kv=1.8) == 3  # 1.8 replicas' worth of KV at 0.8 each


def test_the_larger_need_wins() -> None:
    assert desired(running=12, waiting=6, kv=0.5) == 3
    assert desired(running=2, kv=2.5) == 4


def test_the_maximum_bounds_the_answer() -> None:
    assert desired(running=4, waiting=100, hi=3) == 3


def test_float_noise_in_window_means_does_not_add_a_replica() -> None:
    assert desired(running=8.0000000001, waiting=4) == 2


def test_a_zero_queue_target_scales_on_full_batches() -> None:
    strict = ScalingTargets(
        max_num_seqs=4, target_num_waiting_per_replica=0, target_kv_cache_usage=1
    )
    assert desired_num_replicas(PoolDemand(4, 1, 0), strict, 1, 8) == 2
