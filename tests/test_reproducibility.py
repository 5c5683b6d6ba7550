"""A seeded request returns the same tokens, bit for bit, however it is served.

Cold (the whole prompt computed), warm (its prefix read from the cache), and
inside a busy batch (other prompts chunked beside it, drafts cut to fit): the
logits are batch-invariant (engine.model.batch_invariance) and each draw is
keyed by the seed and the position (engine.sampler), so the tokens and their
log-probabilities must be identical, with and without speculation.
"""

from __future__ import annotations

import pytest
from engine_helpers import Completion, run_requests

from engine.config import SpecDecodeConfig
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams

PROMPT = (
    "The lighthouse keeper wrote in her log every night: the wind, the ships, the sea. "
    "The lighthouse keeper wrote in her log"
)
SEEDED = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234, logprobs=5)
NGRAM = SpecDecodeConfig(method="ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=3)


def _busy(engine: LLMEngine, prompt: list[int]) -> Completion:
    """The seeded request beside five others of different lengths and settings."""
    tokenizer = engine.tokenizer
    others = {
        f"other-{i}": (
            tokenizer.encode(f"Question {i}: why is the number {i * 7} interesting? " * (i + 1)),
            SamplingParams(max_tokens=8 + 4 * i, temperature=1.0 if i % 2 else 0.0),
        )
        for i in range(5)
    }
    return run_requests(engine, {**others, "seeded": (prompt, SEEDED)})["seeded"]


@pytest.mark.parametrize("spec_decode", [None, NGRAM], ids=["plain", "ngram"])
def test_seeded_request_is_identical_cold_warm_and_in_a_busy_batch(make_engine, spec_decode):
    engine = make_engine(spec_decode=spec_decode)
    prompt = engine.tokenizer.encode(PROMPT)
    runs = [run_requests(engine, {"seeded": (prompt, SEEDED)})["seeded"]]  # cold
    runs.append(run_requests(engine, {"seeded": (prompt, SEEDED)})["seeded"])  # warm
    assert runs[-1].num_cached_tokens > 0
    runs += [_busy(engine, prompt) for _ in range(3)]
    assert all(run.token_ids == runs[0].token_ids for run in runs), [r.text for r in runs]
    assert all(run.logprobs == runs[0].logprobs for run in runs)
