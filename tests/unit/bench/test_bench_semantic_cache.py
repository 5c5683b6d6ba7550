"""bench_semantic_cache builds a valid app config, picks held-out pairs the calibration never
saw, and its in-process miss-overhead measurement runs the cache's real lookup."""

from __future__ import annotations

from bench.serving.bench_semantic_cache import (
    DEFAULT_CONFIG,
    FULL,
    QUICK,
    bench_config,
    held_out,
    miss_overhead_ms,
)
from serving.cache.calibration import load_pairs


def test_the_bench_app_has_the_cache_on_and_no_small_pool() -> None:
    config = bench_config(DEFAULT_CONFIG)
    assert config.semantic_cache.enabled and config.semantic_cache.backend == "memory"
    assert config.small_model is None
    assert config.embedding_pool in {p.name for p in config.pools}


def test_held_out_pairs_share_no_question_with_calibration() -> None:
    pairs = load_pairs()
    calibration = {t for p in pairs if p.split == "calibration" for t in (p.a, p.b)}
    for settings, size in ((FULL, 40), (QUICK, QUICK.num_pairs)):
        chosen = held_out(pairs, settings)
        assert {len(v) for v in chosen.values()} == {size}
        assert not calibration & {t for v in chosen.values() for p in v for t in (p.a, p.b)}


def test_the_miss_overhead_runs_real_lookups_on_a_full_index() -> None:
    config = bench_config(DEFAULT_CONFIG)
    small = config.semantic_cache.model_copy(update={"max_entries": 64})
    times = miss_overhead_ms(config.with_changes(semantic_cache=small), num_lookups=20)
    assert len(times) == 20 and all(t > 0 for t in times)
