"""The argmax kernel (engine/kernels/argmax.c) answers exactly as torch.argmax does."""

from __future__ import annotations

import math

import pytest
import torch

from engine.kernels import argmax
from testing.engine_helpers import on_one_and_two_threads

pytestmark = pytest.mark.skipif(argmax._lib() is None, reason="no AVX2 / C compiler here")


def expected(logits: torch.Tensor) -> list[int]:
    return logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("width", [1, 7, 8, 9, 100, 49152])
def test_random_rows_of_every_width(width: int) -> None:
    logits = torch.randn(5, width, generator=torch.Generator().manual_seed(width))
    assert argmax.argmax_rows(logits) == expected(logits)


def test_ties_take_the_first_index_in_the_vector_body_and_the_tail() -> None:
    logits = torch.zeros(4, 21)
    logits[0, [3, 11]] = 5.0  # both in the vector body
    logits[1, [9, 20]] = 5.0  # one in the body, one in the tail
    logits[2, [17, 19]] = 5.0  # both in the tail
    logits[3, 0] = -0.0  # -0.0 == 0.0: the first of the zeros
    assert argmax.argmax_rows(logits) == expected(logits) == [3, 9, 17, 0]


def test_nan_counts_as_the_maximum_and_the_first_nan_wins() -> None:
    logits = torch.randn(4, 30)
    logits[0, [4, 12]] = math.nan
    logits[1, 27] = math.nan  # in the tail
    logits[1, 2] = math.inf
    logits[2] = -math.inf  # a row of -inf: index 0
    logits[3, 5] = math.inf
    assert argmax.argmax_rows(logits) == expected(logits) == [4, 27, 0, 5]


def test_views_and_other_dtypes_fall_back_to_the_same_answer() -> None:
    logits = torch.randn(6, 64)
    assert argmax.argmax_rows(logits[::2, 1:]) == expected(logits[::2, 1:])
    halves = logits.bfloat16()
    assert argmax.argmax_rows(halves) == expected(halves)
    assert argmax.argmax_rows(logits[:0]) == []


def test_many_rows_split_over_threads_give_torchs_answer() -> None:
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(3))
    alone, split = on_one_and_two_threads(lambda: argmax.argmax_rows(logits))
    assert alone == split == expected(logits)
