"""Whether a completion gives a known short answer: the quality measure of checkable tasks.

Forgiving of phrasing, case and punctuation, as a person grading a short answer
would be. Used to label which prompts the small model answers as well as the
default model (the router's training data) and to score the routing evaluation.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:,\d{3})*(?:\.\d+)?")
_OPPOSITES = {
    "yes": "no", "no": "yes", "true": "false", "false": "true",
    "positive": "negative", "negative": "positive",
}  # fmt: skip
"""Answers whose opposite a completion may also mention."""
_MARKED_LETTERS = (
    re.compile(r"\(([A-E])\)", re.IGNORECASE),  # (B)
    re.compile(r"\b([A-E])\)", re.IGNORECASE),  # B)
    re.compile(r"\b([A-E])\.(?!\w)"),  # B.
)
_BARE_LETTER = re.compile(r"\b(A(?! [a-z])|[B-E])\b")


def answer_matches(answer: str, completion: str) -> bool:
    """Whether `completion` gives `answer`, forgiving of phrasing, case and punctuation.

    A number is compared with the completion's first number; an option letter (A-E)
    with the letter the completion names ("B", "B)", "(B)", "The answer is B.");
    anything else must appear as whole words in the completion's first non-empty line,
    and before its opposite when it has one ("No, ... yes" answers no).
    """
    answer = answer.strip()
    if _NUMBER.fullmatch(answer):
        return _number(completion) == _number(answer)
    if re.fullmatch(r"[A-Ea-e]", answer):
        return _letter(completion) == answer.upper()
    first_line = _words(next((line for line in completion.splitlines() if line.strip()), ""))
    said = _words(answer)
    if said not in first_line:
        return False
    opposite = _OPPOSITES.get(said.strip())
    if opposite is None or f" {opposite} " not in first_line:
        return True
    return first_line.index(said) < first_line.index(f" {opposite} ")


def _number(text: str) -> float | None:
    """The first number in `text` (commas as thousands separators); None if it has none."""
    match = _NUMBER.search(text)
    return float(match.group().replace(",", "")) if match else None


def _letter(text: str) -> str | None:
    """The option `text` names: all of it, else the first marked letter, else a bare one."""
    bare = re.sub(r"[\W_]", "", text)
    if len(bare) == 1:
        return bare.upper()
    marked = [match for form in _MARKED_LETTERS if (match := form.search(text))]
    match = min(marked, key=lambda m: m.start()) if marked else _BARE_LETTER.search(text)
    return match.group(1).upper() if match else None


def _words(text: str) -> str:
    """`text` lower-cased, punctuation as spaces, padded by spaces for whole-word search."""
    words = re.sub(r"[\W_]", " ", text.lower()).split()
    return f" {' '.join(words)} "
