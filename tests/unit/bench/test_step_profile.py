"""bench/engine/step_profile.py on the real engine: the parts of a step account for all of it."""

from __future__ import annotations

import pytest

from bench.engine.step_profile import PARTS, profile_steps, step_until_decoding, without_hook_cost
from engine.engine import LLMEngine
from testing.engine_helpers import greedy


def test_a_prefills_parts_add_up_and_the_hooks_are_removed(engine: LLMEngine) -> None:
    engine.add_request("profiled", list(range(1000, 1120)), greedy(1))
    shares = profile_steps(engine)
    assert not engine.has_unfinished()
    assert all(shares[part] >= 0 for part in PARTS), shares
    assert sum(shares[part] for part in PARTS) == pytest.approx(1.0)
    assert shares["linears"] > shares["output_head"] > 0  # 120 rows of matmuls, one head row
    assert shares["total_s"] > 0
    hooked = [m for m in engine.model.modules() if m._forward_hooks or m._forward_pre_hooks]
    assert hooked == []


def test_the_hooks_cost_per_step_comes_out_of_other_model_and_the_total() -> None:
    seconds = {"linears": 1.0, "attention": 0.4, "output_head": 0.2, "other_model": 0.3,
               "outside_model": 0.1}  # fmt: skip
    shares = without_hook_cost(seconds, hooked_steps_s=[1.0, 1.0], plain_steps_s=[0.9, 0.9])
    assert shares["total_s"] == pytest.approx(1.8)  # 0.1 s of hooks in each hooked step
    assert shares["hook_cost"] == pytest.approx(0.1)
    assert shares["other_model"] == pytest.approx(0.1 / 1.8)
    assert shares["linears"] == pytest.approx(1.0 / 1.8)
    assert sum(shares[part] for part in PARTS) == pytest.approx(1.0)


def test_no_hook_cost_is_taken_without_steps_to_compare_or_when_plain_steps_were_slower() -> None:
    seconds = {"linears": 0.6, "attention": 0.2, "output_head": 0.1, "other_model": 0.05,
               "outside_model": 0.05}  # fmt: skip
    expected = {**seconds, "total_s": 1.0, "hook_cost": 0.0}
    assert without_hook_cost(seconds, [1.0], []) == pytest.approx(expected)
    assert without_hook_cost(seconds, [0.5, 0.5], [0.6, 0.6]) == pytest.approx(expected)


def test_decode_steps_alternate_hooked_and_plain(engine: LLMEngine) -> None:
    engine.add_request("decoding", list(range(1000, 1040)), greedy(9))
    step_until_decoding(engine, {"decoding"})
    shares = profile_steps(engine, every_other=True)  # 8 decode steps, 4 of them hooked
    assert not engine.has_unfinished()
    assert sum(shares[part] for part in PARTS) == pytest.approx(1.0)
    assert all(shares[part] >= 0 for part in PARTS), shares
    assert 0 <= shares["hook_cost"] < 0.5
