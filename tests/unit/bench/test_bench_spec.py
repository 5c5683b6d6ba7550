"""bench_spec's comparison on real engines: both sides run the same prompt, the speculating
side's time is split into its parts, and greedy output stays the plain engine's."""

from __future__ import annotations

import pytest

from bench.engine.bench_spec import compare, load_prompts
from engine.config import EngineConfig, SpecDecodeConfig
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams
from testing.engine_helpers import TEST_ENGINE_CONFIG

NGRAM = SpecDecodeConfig(method="ngram", num_speculative_tokens=4, ngram_min=1, ngram_max=3)


@pytest.mark.slow  # left out of `make test-fast`; `make test` runs it
def test_compare_times_every_part_of_a_speculating_step_and_keeps_greedy_output():
    """Fresh engines: instrumenting wraps their methods, which a shared engine would keep."""
    plain = LLMEngine(EngineConfig(**TEST_ENGINE_CONFIG))
    spec = LLMEngine(EngineConfig(**TEST_ENGINE_CONFIG, spec_decode=NGRAM))
    prompts = load_prompts(plain, "grounded", limit=1)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    base, sped, counters, _, spec_timings = compare(plain, spec, prompts, params)
    assert counters["greedy_match_frac"] == 1.0
    assert counters["num_drafts"] > 0
    assert base.tpot_ms > 0 and sped.tpot_ms > 0
    assert any(name.startswith("forward_") for name in spec_timings.calls)
    calls = spec_timings.calls  # a step that only prefills part of a prompt samples nothing
    assert 0 < calls["sample_and_verify"] <= calls["step"] and calls["propose"] > 0
