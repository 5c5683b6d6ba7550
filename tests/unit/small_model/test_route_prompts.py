"""The difficulty-routing prompt sets (small_model/prompts.py): pure Python, no model."""

from __future__ import annotations

import ast
import json
import operator
import re
from collections import Counter

import pytest

from small_model.answer_check import answer_matches
from small_model.prompts import (
    DISTILL_SET,
    LABELLED_SET,
    LEVELS,
    MAX_TOKENS,
    OPEN_TASKS,
    distill_prompts,
    labelled_prompts,
    to_jsonl,
)

LABELLED = [json.loads(line) for line in LABELLED_SET.read_text(encoding="utf-8").splitlines()]
DISTILL = [json.loads(line) for line in DISTILL_SET.read_text(encoding="utf-8").splitlines()]
CHECKABLE = [row for row in LABELLED if row["answer"] is not None]
OPPOSITE = {"yes": "no", "no": "yes", "positive": "negative", "negative": "positive"}


def _rows(task: str) -> list[dict]:
    return [row for row in LABELLED if row["task"] == task]


def test_files_are_what_the_generator_writes() -> None:
    assert LABELLED_SET.read_text(encoding="utf-8") == to_jsonl(labelled_prompts())
    assert DISTILL_SET.read_text(encoding="utf-8") == to_jsonl(distill_prompts())


def test_generation_is_deterministic_and_seeded() -> None:
    assert to_jsonl(distill_prompts(seed=1)) == to_jsonl(distill_prompts(seed=1))
    assert to_jsonl(labelled_prompts(seed=1)) != to_jsonl(labelled_prompts(seed=0))


@pytest.mark.parametrize("seed", [0, 1])
def test_splits_are_disjoint_and_sized_as_designed(seed: int) -> None:
    rows = labelled_prompts(seed)
    assert Counter(row["split"] for row in rows) == {"train": 240, "eval": 160}
    assert len({row["prompt"] for row in rows}) == len({row["id"] for row in rows}) == 400
    per_split = Counter((row["task"], row["level"], row["split"]) for row in rows)
    for (task, level, split), n in per_split.items():
        if split == "train":  # three train prompts for every two held out
            assert n * 2 == per_split[task, level, "eval"] * 3, (task, level)
    distill = distill_prompts(seed)
    assert len(distill) == len({row["prompt"] for row in distill}) == 800
    assert {row["prompt"] for row in rows}.isdisjoint(row["prompt"] for row in distill)


def test_every_task_is_in_both_splits() -> None:
    tasks = {
        split: {row["task"] for row in LABELLED if row["split"] == split}
        for split in ("train", "eval")
    }
    assert tasks["train"] == tasks["eval"] == set(MAX_TOKENS)


def test_labelled_rows_are_well_formed() -> None:
    keys = {"id", "split", "task", "level", "prompt", "answer", "max_tokens"}
    for row in LABELLED:
        assert set(row) == keys
        assert row["level"] in LEVELS
        assert 8 <= row["max_tokens"] <= 96
        assert (row["answer"] is None) == (row["task"] in OPEN_TASKS), row
    assert len(CHECKABLE) > len(LABELLED) / 2
    assert all(set(row) == {"id", "prompt"} for row in DISTILL)


def test_no_labelled_prompt_is_in_the_distillation_set() -> None:
    assert {row["prompt"] for row in LABELLED}.isdisjoint(row["prompt"] for row in DISTILL)


@pytest.mark.parametrize("row", CHECKABLE, ids=[row["id"] for row in CHECKABLE])
def test_answer_is_matched_by_a_plausible_completion_only(row: dict) -> None:
    answer = row["answer"]
    assert answer_matches(answer, f"The answer is {answer}.")
    if re.fullmatch(r"-?\d+(\.\d+)?", answer):
        wrong = str(float(answer) + 1)
    elif re.fullmatch(r"[A-D]", answer):
        wrong = "C" if answer != "C" else "A"
    else:
        wrong = OPPOSITE.get(answer, "nothing")
    assert not answer_matches(answer, f"The answer is {wrong}.")


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _evaluate(node: ast.expr) -> int:
    """An expression of integers, +, - and * (nothing else is allowed through)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    assert isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS, ast.dump(node)
    return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))


@pytest.mark.parametrize("row", _rows("arithmetic"), ids=lambda row: row["id"])
def test_arithmetic_answers_are_right(row: dict) -> None:
    expression = re.search(r"[\d(][\d\s+\-×()]*[\d)]", row["prompt"]).group()
    value = _evaluate(ast.parse(expression.replace("×", "*"), mode="eval").body)
    assert row["answer"] == str(value)


def test_compare_and_count_answers_are_right() -> None:
    for row in _rows("compare"):
        word, x, y = re.search(
            r"(larger|smaller)[,:]? ([\d.]+) or ([\d.]+)", row["prompt"]
        ).groups()
        pick = max if word == "larger" else min
        assert row["answer"] == pick(x, y, key=float)
    for row in _rows("count"):
        prompt = row["prompt"]
        if letter := re.search(r'letter "(.)" appear in the word "(\w+)"', prompt):
            expected = letter.group(2).count(letter.group(1))
        elif items := re.search(r"list: (.*)\?", prompt):
            expected = len(items.group(1).split(", "))
        else:
            expected = len(re.search(r'sentence: "(.*)"', prompt).group(1).split())
        assert row["answer"] == str(expected), prompt


@pytest.mark.parametrize(
    ("answer", "completion", "expected"),
    [
        ("12", "12", True),
        ("12", "The answer is 12.", True),
        ("12", "12 apples in all, not 13.", True),
        ("1234", "That makes 1,234.", True),
        ("3.9", "3.90 is larger than 3.11", True),
        ("12", "It is 13, since 12 is too small.", False),
        ("12", "I do not know.", False),
        ("B", "B", True),
        ("B", "b)", True),
        ("B", "(B)", True),
        ("B", "B. green", True),
        ("B", "The answer is B, green.", True),
        ("B", "A cat is not a colour, so the answer is B", True),
        ("B", "Answer: B. The others, (A), (C) and (D), are wrong.", True),
        ("B", "A) table", False),
        ("B", "The answer is C.", False),
        ("Paris", "paris", True),
        ("Paris", "The capital of France is **Paris**.", True),
        ("Paris", "\nParis is the capital.\nNot Lyon.", True),
        ("Paris", "Parisian food is famous.", False),
        ("Paris", "It is Lyon.\nParis is bigger though.", False),
        ("Mexico City", "The capital is Mexico City.", True),
        ("no", "No, a whale is a mammal.", True),
        ("no", "Not sure, yes.", False),
        ("positive", "Positive", True),
        ("positive", "Negative.", False),
    ],
)
def test_answer_matches(answer: str, completion: str, expected: bool) -> None:
    assert answer_matches(answer, completion) is expected
