"""The small-model router's prompt features: named in order, deterministic, finite and
bounded on any input, each cue found where it is and only there."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.difficulty import CUES, FEATURE_NAMES, MAX_CHARS, MAX_WORD_LENGTH, prompt_features

FLAGS = {"arithmetic", "multiple_choice", *CUES}
UNIT_SHARES = {"digit_share", "type_token_ratio", "repeated_bigram_share"}


def _assert_bounded(features: dict[str, float]) -> None:
    assert tuple(features) == FEATURE_NAMES
    assert all(math.isfinite(v) for v in features.values())
    for name, value in features.items():
        if name in FLAGS:
            assert value in (0.0, 1.0), name
        elif name in UNIT_SHARES:
            assert 0.0 <= value <= 1.0, name
        elif name == "mean_word_length":
            assert 0.0 <= value <= MAX_WORD_LENGTH
        else:  # logarithms of capped counts
            assert 0.0 <= value <= 25.0, name


def test_features_are_named_in_order_and_deterministic() -> None:
    text = "What is 3 + 4? Explain why, step by step."
    first = prompt_features(text, 12, 64)
    assert tuple(first) == FEATURE_NAMES
    assert first == prompt_features(text, 12, 64)
    assert first["log_prompt_tokens"] == pytest.approx(math.log1p(12))
    assert first["log_max_tokens"] == pytest.approx(math.log1p(64))
    assert prompt_features(text, 12, None)["log_max_tokens"] == 0.0


@pytest.mark.parametrize(
    "text",
    ["", " \n\t ", "a" * 1_000_000, "漢字 é 🙂 مرحبا " * 500, "\x00\ud800", "1" * 9000, "?" * 9000],
)
@pytest.mark.parametrize(("tokens", "max_tokens"), [(0, None), (-5, -1), (10**30, 10**30)])
def test_features_are_finite_and_bounded_on_odd_input(
    text: str, tokens: int, max_tokens: int | None
) -> None:
    _assert_bounded(prompt_features(text, tokens, max_tokens))


def test_only_the_first_max_chars_are_read() -> None:
    head = ("Explain why the tides rise. " * 400)[:MAX_CHARS]
    tail = " Write a poem with 1 + 2 and options (a) or (b)." * 100
    assert prompt_features(head + tail, 100, 10) == prompt_features(head, 100, 10)


@pytest.mark.parametrize(
    ("text", "feature"),
    [
        ("What is the capital of France?", "cue_factual"),
        ("Who painted this\nwhat\nis it", "cue_factual"),
        ("Explain why the sky is blue, step-by-step.", "cue_reasoning"),
        ("Write a short poem about rain.", "cue_generation"),
        ("Summarize the text below.", "cue_transform"),
        ("What is 17 + 25?", "arithmetic"),
        ("Compute nine times eight", "arithmetic"),
        ("Pick one: (a) red (b) blue", "multiple_choice"),
        ("Colour?\nA) red\nB) blue", "multiple_choice"),
    ],
)
def test_cues_are_found(text: str, feature: str) -> None:
    assert prompt_features(text, 10, 10)[feature] == 1.0


def test_no_cue_in_plain_text() -> None:
    features = prompt_features("Somewhat isolated, the year 2024 was calm (mostly).", 10, 10)
    assert all(features[name] == 0.0 for name in FLAGS)


def test_word_shape_features() -> None:
    features = prompt_features("copy this copy this copy this", 6, None)
    assert features["type_token_ratio"] == pytest.approx(2 / 6)
    assert features["repeated_bigram_share"] == pytest.approx(1 - 2 / 5)  # 5 bigrams, 2 kinds
    assert features["mean_word_length"] == pytest.approx(4.0)
    assert features["digit_share"] == 0.0
    assert prompt_features("ab 12", 2, None)["digit_share"] == pytest.approx(2 / 5)


@settings(deadline=None, max_examples=150)
@given(st.text(), st.integers(), st.one_of(st.none(), st.integers()))
def test_features_never_raise_and_stay_finite(
    text: str, tokens: int, max_tokens: int | None
) -> None:
    _assert_bounded(prompt_features(text, tokens, max_tokens))
