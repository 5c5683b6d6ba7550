"""Incremental detokenization and stop strings: unit level, then through the engine."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.detokenizer import IncrementalDetokenizer, StopStringFilter
from engine.model.chat import chat_prompt_ids
from testing.engine_helpers import greedy, run_one

MULTIBYTE_TEXT = "Café 👋 naïve 世界! 🇫🇷 — déjà vu, 😀😀 end"
PROMPT_TEXT = "Say something:"


def split(items: list, cuts: list[int]) -> list[list]:
    bounds = [0, *sorted(c % (len(items) + 1) for c in cuts), len(items)]
    return [items[a:b] for a, b in itertools.pairwise(bounds)]


def stream(tokenizer, prompt_ids: list[int], pieces: list[list[int]]) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    return [detokenizer.push(piece) for piece in pieces]


def expected_text(tokenizer, prompt_ids: list[int], output_ids: list[int]) -> str:
    """What the output adds to the decoded prompt, decoded in one go."""
    prompt = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    full = tokenizer.decode(prompt_ids + output_ids, skip_special_tokens=True)
    assert full.startswith(prompt)
    return full[len(prompt) :]


# ---- IncrementalDetokenizer --------------------------------------------------------


def test_multibyte_text_streamed_token_by_token(tokenizer):
    prompt_ids = tokenizer.encode(PROMPT_TEXT)
    output_ids = tokenizer.encode(" " + MULTIBYTE_TEXT)
    deltas = stream(tokenizer, prompt_ids, [[t] for t in output_ids])
    assert "".join(deltas) == " " + MULTIBYTE_TEXT
    assert not any("\ufffd" in delta for delta in deltas)
    assert "" in deltas  # some emoji really spans tokens: held back, not broken


def test_leading_spaces_survive_from_the_first_token(tokenizer):
    prompt_ids = tokenizer.encode("Hello")
    output_ids = tokenizer.encode(" big  world")
    assert "".join(stream(tokenizer, prompt_ids, [[t] for t in output_ids])) == " big  world"


def test_special_tokens_are_not_printed(tokenizer):
    prompt_ids = tokenizer.encode("Hi")
    deltas = stream(tokenizer, prompt_ids, [tokenizer.encode(" there"), [tokenizer.eos_token_id]])
    assert deltas == [" there", ""]


def test_special_tokens_are_printed_when_not_skipped(tokenizer):
    prompt_ids = tokenizer.encode("Hi")
    output_ids = [*tokenizer.encode(" there"), tokenizer.eos_token_id]
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=False)
    text = "".join(detokenizer.push([t]) for t in output_ids)
    assert text == " there" + tokenizer.eos_token
    assert text == tokenizer.decode(output_ids, skip_special_tokens=False)


@settings(max_examples=60, deadline=None)
@given(
    text=st.text(alphabet="ab é世界👋😀🇫🇷\n", min_size=1, max_size=24),
    cuts=st.lists(st.integers(0, 100), max_size=8),
)
def test_any_chunking_concatenates_to_the_full_decode(tokenizer, text: str, cuts: list[int]):
    prompt_ids = tokenizer.encode(PROMPT_TEXT)
    output_ids = tokenizer.encode(text)
    deltas = stream(tokenizer, prompt_ids, split(output_ids, cuts))
    assert "".join(deltas) == expected_text(tokenizer, prompt_ids, output_ids)
    assert not any("\ufffd" in delta for delta in deltas)


# ---- StopStringFilter -----------------------------------------------------------


def filter_stream(
    stop: tuple[str, ...], pieces: list[str], include_stop: bool = False
) -> tuple[str, bool]:
    """Push pieces until a stop hits (the last piece is final); return (emitted, hit)."""
    stop_filter, emitted = StopStringFilter(stop, include_stop), ""
    for i, piece in enumerate(pieces):
        text, hit = stop_filter.push(piece, final=i == len(pieces) - 1)
        emitted += text
        if hit:
            return emitted, True
    return emitted, False


def test_stop_string_split_across_pieces_is_cut_out():
    assert filter_stream(("STOP",), ["abc ST", "O", "P and more"]) == ("abc ", True)


def test_filter_holds_back_one_character_less_than_the_longest_stop_until_final():
    stop_filter = StopStringFilter(("xyz", "q"))
    assert stop_filter.push("hello x", final=False) == ("hello", False)
    assert stop_filter.push("!", final=False) == (" ", False)
    assert stop_filter.push("", final=True) == ("x!", False)


def test_filter_without_stop_strings_passes_text_straight_through():
    assert StopStringFilter(()).push("abc", final=False) == ("abc", False)


def test_earliest_of_several_stop_strings_wins():
    assert filter_stream(("world", "lo"), ["hello world"]) == ("hel", True)


def test_a_kept_stop_string_ends_the_text():
    assert filter_stream(("STOP",), ["abc ST", "O", "P and more"], True) == ("abc STOP", True)
    assert filter_stream(("world", "lo"), ["hello world"], True) == ("hello", True)
    assert filter_stream(("ab", "abc"), ["xabcd"], True) == ("xabc", True)  # longest at a tie


def unbuffered_stop(
    stop: tuple[str, ...], pieces: list[str], include_stop: bool = False
) -> tuple[str, bool]:
    """The reference: search everything seen so far after each piece, hold nothing back."""
    seen = ""
    for piece in pieces:
        seen += piece
        hits = sorted((seen.find(s), -len(s)) for s in stop if s in seen)
        if hits:
            start, minus_length = hits[0]
            return seen[: start - minus_length if include_stop else start], True
    return seen, False


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=30),
    stop=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 100), max_size=8),
)
def test_filter_holding_back_gives_what_an_unbuffered_search_gives(text, stop, cuts):
    pieces = ["".join(p) for p in split(list(text), cuts)]
    emitted, hit = filter_stream(tuple(stop), pieces)
    assert (emitted, hit) == unbuffered_stop(tuple(stop), pieces)
    assert not any(s in emitted for s in stop)
    kept = filter_stream(tuple(stop), pieces, include_stop=True)
    assert kept == unbuffered_stop(tuple(stop), pieces, include_stop=True)


# ---- through the engine -----------------------------------------------------------


def test_stop_string_spanning_tokens_ends_the_request_and_is_not_returned(engine, tokenizer):
    prompt = chat_prompt_ids(tokenizer, "What is the capital of France?")
    free = run_one(engine, prompt, greedy(12))
    pieces = [tokenizer.decode([t], skip_special_tokens=True) for t in free.token_ids]
    assert "".join(pieces) == free.text
    # The last two characters of the 2nd token and the first two of the 3rd.
    boundary = len(pieces[0]) + len(pieces[1])
    stop = free.text[boundary - 2 : boundary + 2]
    assert len(stop) == 4 and free.text.find(stop) == boundary - 2

    stopped = run_one(engine, prompt, greedy(12, stop=(stop,)))
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: boundary - 2]
    assert stopped.token_ids == free.token_ids[:3]


def test_multibyte_output_streams_without_broken_characters(engine, tokenizer):
    prompt = chat_prompt_ids(tokenizer, "Write three emoji and the word 世界, nothing else.")
    completion = run_one(engine, prompt, greedy(16))
    assert any(ord(char) > 0x7F for char in completion.text)
    assert "\ufffd" not in completion.text
    # A request cut off by max_tokens mid-character drops the half character.
    full = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    assert completion.text == full.rstrip("\ufffd")


def test_stop_token_ids_end_the_request_at_the_first_listed_token(engine, tokenizer):
    prompt = chat_prompt_ids(tokenizer, "What is the capital of France?")
    free = run_one(engine, prompt, greedy(12))
    stop_token = free.token_ids[2]
    first = free.token_ids.index(stop_token)

    stopped = run_one(engine, prompt, greedy(12, stop_token_ids=(stop_token,)))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert stopped.text == tokenizer.decode(free.token_ids[:first], skip_special_tokens=True)

    kept = run_one(
        engine, prompt, greedy(12, stop_token_ids=(stop_token,), include_stop_str_in_output=True)
    )
    assert kept.text == tokenizer.decode(free.token_ids[: first + 1], skip_special_tokens=True)


def test_kept_stop_string_and_special_tokens_through_the_engine(engine, tokenizer):
    prompt = chat_prompt_ids(tokenizer, "Reply with one word: yes or no?")
    free = run_one(engine, prompt, greedy(16))
    assert free.finish_reason == "stop" and tokenizer.eos_token not in free.text
    shown = run_one(
        engine,
        prompt,
        greedy(16, skip_special_tokens=False, include_stop_str_in_output=True),
    )
    assert shown.text == free.text + tokenizer.eos_token  # EOS's own text, kept and shown

    stop = free.text[1:3]
    kept = run_one(engine, prompt, greedy(16, stop=(stop,), include_stop_str_in_output=True))
    assert kept.finish_reason == "stop" and kept.text == free.text[:3]
