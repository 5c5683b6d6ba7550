"""bench_peer builds what it runs: every case at both thread counts, each runnable."""

from __future__ import annotations

from bench.engine.bench_peer import cases
from bench.engine.peer import Case, run_tierserve


def test_every_case_runs_at_one_thread_and_at_two_for_the_ratio() -> None:
    by_threads = cases(quick=True)
    names = [case.name for case in by_threads[1]]
    assert names == ["c64", "c4", "c1"]
    assert [case.name for case in by_threads[2]] == [f"{name}.t2" for name in names]
    for one, two in zip(by_threads[1], by_threads[2], strict=True):
        assert (one.prompts, one.max_tokens, one.batch) == (two.prompts, two.max_tokens, two.batch)


def test_a_case_runs_on_the_engine(make_engine) -> None:
    prompts = cases(quick=True)[1][2].prompts[:2]
    timing = run_tierserve(make_engine(), Case("tiny", prompts, max_tokens=3, batch=2))
    assert timing.tok_s > 0
