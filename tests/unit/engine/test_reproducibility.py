"""A seeded request returns the same tokens, bit for bit, however it is served.

Cold (the whole prompt computed), warm (its prefix read from the cache), inside
a busy batch (other prompts chunked beside it, drafts cut to fit), and with or
without speculation: the logits are batch-invariant
(engine.model.batch_invariance) and each draw is keyed by the seed and the
position (engine.sampler), so the tokens and their log-probabilities must be
identical. In every dtype a pool may serve: fp32, and bf16 (what `auto` picks on
CPUs with native bf16), where a probe that stopped short of the step's row
counts once let speculation change the output.
"""

from __future__ import annotations

import pytest

from engine.config import SpecDecodeConfig
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams
from testing.engine_helpers import Completion, run_requests

PROMPT = (
    "The lighthouse keeper wrote in her log every night: the wind, the ships, the sea. "
    "The lighthouse keeper wrote in her log"
)
SEEDED = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234, logprobs=5)
NGRAM = SpecDecodeConfig(method="ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=3)
DTYPES = ["float32", "bfloat16"]
"""Every dtype a pool may serve here."""


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


def _cold_warm_busy(engine: LLMEngine, prompt: list[int]) -> list[Completion]:
    """The seeded request alone with its prompt computed whole, then read from the prefix
    cache, then twice in a busy batch."""
    runs = [run_requests(engine, {"seeded": (prompt, SEEDED)})["seeded"]]  # cold
    runs.append(run_requests(engine, {"seeded": (prompt, SEEDED)})["seeded"])  # warm
    assert runs[-1].num_cached_tokens > 0
    return runs + [_busy(engine, prompt) for _ in range(2)]


@pytest.mark.slow  # left out of `make test-fast`; `make test` runs it
@pytest.mark.parametrize("dtype", DTYPES)
def test_seeded_request_is_identical_cold_warm_busy_with_and_without_speculation(
    make_engine, dtype
):
    runs: list[Completion] = []
    for spec_decode in (None, NGRAM):
        engine = make_engine(dtype=dtype, spec_decode=spec_decode)
        runs += _cold_warm_busy(engine, engine.tokenizer.encode(PROMPT))
    assert all(run.token_ids == runs[0].token_ids for run in runs), [r.text for r in runs]
    assert all(run.logprobs == runs[0].logprobs for run in runs)


def test_the_engine_says_whether_a_seed_reproduces(make_engine) -> None:
    """What /v1/models reports: batch-invariant logits here, and none when switched off."""
    assert make_engine().stats().seeded_reproducible
    assert not make_engine(batch_invariant=False).stats().seeded_reproducible
