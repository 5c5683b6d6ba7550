"""The engine's token counters: recent rates over a window that ends now."""

from __future__ import annotations

import pytest

from engine import token_counters
from engine.token_counters import RATE_WINDOW_S, TokenCounters


def test_the_prompt_rate_is_over_the_window_up_to_now_idle_time_included(monkeypatch):
    """A decode shares its steps with the prompts computed of late: their rate counts idle
    time too, and steps older than the window drop out even while no new step comes."""
    now_s = [100.0]
    monkeypatch.setattr(token_counters.time, "monotonic", lambda: now_s[0])
    counters = TokenCounters()
    counters.count_step(num_generated=4, num_prompt_computed=200)
    now_s[0] += 1.0
    counters.count_step(num_generated=4, num_prompt_computed=300)
    assert counters.prompt_compute_rate() == pytest.approx(500 / RATE_WINDOW_S)
    assert counters.generation_rate() == pytest.approx(8 / 1.0)
    assert counters.num_generation_tokens == 8
    now_s[0] += RATE_WINDOW_S - 0.5  # the first step is out of the window
    assert counters.prompt_compute_rate() == pytest.approx(300 / RATE_WINDOW_S)
    now_s[0] += 1.0
    assert counters.prompt_compute_rate() == 0.0
