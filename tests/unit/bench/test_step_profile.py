"""bench/engine/step_profile.py on the real engine: the parts of a step account for all of it."""

from __future__ import annotations

import pytest

from bench.engine.step_profile import PARTS, profile_steps
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
