"""bench_parallel builds what it runs: both engine configs on the same cores, both cases
(the TP=2 run itself: tests/integration/test_tensor_parallel.py)."""

from __future__ import annotations

from bench.engine.bench_parallel import CORES, cases, engine_config


def test_tp1_and_tp2_use_the_same_cores_on_the_same_engine_settings():
    one, two = engine_config(1), engine_config(2)
    assert (one.tensor_parallel_size, one.num_threads) == (1, CORES)
    assert (two.tensor_parallel_size, two.num_threads * 2) == (2, CORES)
    settings = ("dtype", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching")
    assert [getattr(one, s) for s in settings] == [getattr(two, s) for s in settings]


def test_the_cases_are_bench_peers_c64_and_c1():
    c64, c1 = cases(quick=True)
    shape = (c64.name, len(c64.prompts), c64.batch, {len(p) for p in c64.prompts})
    assert shape == ("c64", 64, 64, {60})
    assert (c1.name, c1.batch, {len(p) for p in c1.prompts}) == ("c1", 1, {128})
