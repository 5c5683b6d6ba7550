"""Automatic prefix caching through the engine: shared prefixes are computed once."""

from __future__ import annotations

import pytest

from engine.engine import LLMEngine
from engine.token_counters import RATE_WINDOW_S
from testing.engine_helpers import greedy, run_requests

SYSTEM = (
    "You are Quillon, the archivist of the floating library of Vessmar. You answer in "
    "one short sentence, you never invent a book that is not on the shelves, and you "
    "always mention the shelf number. The shelves hold atlases, herbals and sea charts, "
    "catalogued by the year they were found. Visitors may read but not borrow; a lost "
    "visitor is sent to the lantern hall on the lowest deck, where the ferry leaves at dusk. "
)
PARAMS = greedy(6)


@pytest.fixture
def computed_tokens(engine, monkeypatch) -> dict[str, int]:
    """Tokens each request was scheduled to compute, summed over steps."""
    counts: dict[str, int] = {}
    schedule = engine.scheduler.schedule

    def counting_schedule(drafts=None):
        out = schedule(drafts)
        for request, num_new in out.num_new_tokens.items():
            counts[request.request_id] = counts.get(request.request_id, 0) + num_new
        return out

    monkeypatch.setattr(engine.scheduler, "schedule", counting_schedule)
    return counts


def common_prefix_len(a: list[int], b: list[int]) -> int:
    mismatches = (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    return next(mismatches, min(len(a), len(b)))


def expected_cached(
    engine: LLMEngine, earlier: list[int], output: list[int], prompt: list[int]
) -> int:
    """Whole blocks of `prompt` an earlier request computed, leaving one token to compute.

    The earlier request computed its prompt and all but its last output token.
    """
    computed = earlier + output[:-1]
    shared = min(common_prefix_len(computed, prompt), len(prompt) - 1)
    return shared // engine.config.block_size * engine.config.block_size


def test_second_request_computes_only_its_new_tokens(
    engine, make_engine, tokenizer, computed_tokens
):
    first = tokenizer.encode(SYSTEM + "Question: where are the sea charts?")
    second = tokenizer.encode(SYSTEM + "Question: do you have a herbal?")
    hits_before = engine.stats().prefix_cache_hits

    a = run_requests(engine, {"first": (first, PARAMS)})["first"]
    b = run_requests(engine, {"second": (second, PARAMS)})["second"]

    num_cached = expected_cached(engine, first, a.token_ids, second)
    assert num_cached >= 4 * engine.config.block_size  # the system prompt is long
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, num_cached)
    # Every token is computed once, except the last sampled one, which never is.
    assert computed_tokens["first"] == len(first) + len(a.token_ids) - 1
    assert computed_tokens["second"] == len(second) - num_cached + len(b.token_ids) - 1
    assert engine.stats().prefix_cache_hits - hits_before == num_cached

    uncached = make_engine(enable_prefix_caching=False)
    cold = run_requests(uncached, {"second": (second, PARAMS)})["second"]
    assert cold.num_cached_tokens == 0
    assert (b.token_ids, b.text) == (cold.token_ids, cold.text)


def test_repeated_prompt_reuses_its_own_output_blocks(engine, tokenizer, computed_tokens):
    prompt = tokenizer.encode(SYSTEM + "Question: what is on shelf nine?")
    # 17 tokens: the answer fills at least one block past the prompt's last full one.
    first = run_requests(engine, {"once": (prompt, greedy(17, ignore_eos=True))})["once"]
    # The follow-up turn carries the first answer: its blocks were cached as they filled.
    follow_up = prompt + first.token_ids + tokenizer.encode(" And shelf ten?")
    second = run_requests(engine, {"again": (follow_up, PARAMS)})["again"]

    num_cached = expected_cached(engine, prompt, first.token_ids, follow_up)
    assert second.num_cached_tokens == num_cached > len(prompt)
    assert computed_tokens["again"] == len(follow_up) - num_cached + len(second.token_ids) - 1


def test_request_finishing_in_its_first_step_still_fills_the_cache(engine, tokenizer):
    """max_tokens=1: the prompt is computed and the request freed in one step; its blocks
    must have been named before they were freed."""
    prompt = tokenizer.encode(SYSTEM + "Question: one word?")
    run_requests(engine, {"once": (prompt, greedy(1))})
    hits_before = engine.stats().prefix_cache_hits
    run_requests(engine, {"again": (prompt, greedy(1))})
    block = engine.config.block_size
    assert engine.stats().prefix_cache_hits - hits_before == (len(prompt) - 1) // block * block


def test_the_prompt_rate_counts_the_tokens_computed_not_those_the_cache_held(
    make_engine, tokenizer
):
    """`prompt_tokens_computed_per_s` (what placement stretches a decode step by) counts a
    prompt's computed tokens over the rate window: not what the prefix cache held, not the
    output tokens."""
    engine = make_engine()
    engine.counters.reset()  # the engine is shared: earlier tests' steps out of the window
    first = tokenizer.encode(SYSTEM + "Question: where are the sea charts?")
    second = tokenizer.encode(SYSTEM + "Question: do you have a herbal?")
    a = run_requests(engine, {"first": (first, PARAMS)})["first"]
    b = run_requests(engine, {"second": (second, PARAMS)})["second"]
    computed = len(first) + len(second) - a.num_cached_tokens - b.num_cached_tokens
    assert b.num_cached_tokens > 0
    rate = engine.stats().prompt_tokens_computed_per_s
    assert rate * RATE_WINDOW_S == pytest.approx(computed)
