"""Linear layers computed only at batch-invariant row counts: rows agree bit for bit.

The BLAS here may agree at every row count; a kernel that switches with the
call's shape is what the probe exists for, so two layers below switch on
purpose, as libraries do: one below a few rows, one above a size the old
32-row probe never reached.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.model.batch_invariance import (
    RowBounded,
    RowBounds,
    invariant_row_bounds,
    make_batch_invariant,
    probe_row_counts,
)


class SwitchingLinear(nn.Linear):
    """An nn.Linear whose summation order changes with the call's row count, as a BLAS's
    does when it picks another kernel: calls of fewer than `few` rows, or more than
    `many`, sum the input dimension in two halves. Each row is computed alone, so within
    one kernel a row's result depends on nothing else."""

    def __init__(self, in_features: int, out_features: int, few: int, many: int) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.few, self.many = few, many

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T, in a row-count-dependent order."""
        if self.few <= x.shape[0] <= self.many:
            return torch.cat([F.linear(row, self.weight) for row in x.split(1)])
        half = self.in_features // 2
        low, high = self.weight[:, :half], self.weight[:, half:]
        return torch.cat(
            [F.linear(row[:, :half], low) + F.linear(row[:, half:], high) for row in x.split(1)]
        )


def _rows_depend_on_the_call(layer: nn.Module, x: torch.Tensor, counts: range) -> list[int]:
    """Row counts at which some row's output differs from the same row computed in the
    call of every row of x, at the start of the call or 7 rows in."""
    with torch.inference_mode():
        full = layer(x)
        return [
            n for n in counts
            if not torch.equal(layer(x[:n]), full[:n])
            or not torch.equal(layer(x[7 : 7 + n]), full[7 : 7 + n])
        ]  # fmt: skip


def test_every_linear_is_wrapped_and_its_rows_no_longer_depend_on_the_batch() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 384), nn.ReLU(), nn.Linear(384, 96))
    x = torch.randn(40, 96)
    assert make_batch_invariant(model, torch.float32, max_rows=48)
    for layer in (model[0], model[2]):
        if isinstance(layer, RowBounded):
            assert layer.bounds == invariant_row_bounds(layer.linear, torch.float32, 48)
    assert _rows_depend_on_the_call(model, x, range(1, 34)) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_kernel_switch_past_the_old_probe_is_found_and_avoided(dtype) -> None:
    torch.manual_seed(1)
    layer = SwitchingLinear(128, 64, few=4, many=48).to(dtype)
    x = torch.randn(200, 128).to(dtype)
    assert _rows_depend_on_the_call(layer, x, range(1, 150)), "the layer must switch"

    bounds = invariant_row_bounds(layer, dtype, max_rows=256)
    assert bounds is not None and bounds.min_rows == 4 and bounds.max_rows is not None
    assert 4 <= bounds.max_rows <= 48
    bounded = RowBounded(layer, bounds)
    assert _rows_depend_on_the_call(bounded, x, range(1, 193)) == []


class RowAloneLinear(nn.Linear):
    """An nn.Linear that sums a lone row in another order, as a BLAS's GEMV does beside
    its GEMM, where that order rounds otherwise: here, rows whose first input is
    positive. Calls of several rows agree with each other row by row and place by place,
    and the probe's first row (negative) agrees alone too."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T, row by row; a lone row with a positive first input in two halves."""
        if x.shape[0] > 1 or x[0, 0] <= 0:
            return torch.cat([F.linear(row, self.weight) for row in x.split(1)])
        half = self.in_features // 2
        low, high = self.weight[:, :half], self.weight[:, half:]
        return F.linear(x[:, :half], low) + F.linear(x[:, half:], high)


def test_a_row_computed_alone_otherwise_than_in_a_call_of_more_is_padded() -> None:
    torch.manual_seed(2)
    layer = RowAloneLinear(128, 64, bias=False)
    bounds = invariant_row_bounds(layer, torch.float32, max_rows=64)
    assert bounds == RowBounds(2, None)
    x = torch.randn(40, 128)
    bounded = RowBounded(layer, bounds)
    with torch.inference_mode():
        together = bounded(x)
        alone = torch.cat([bounded(row) for row in x.split(1)])
        assert not torch.equal(torch.cat([layer(row) for row in x.split(1)]), together)
    assert torch.equal(alone, together)


def test_a_layer_that_agrees_everywhere_is_left_as_it_is() -> None:
    model = nn.Sequential(SwitchingLinear(64, 32, few=1, many=10_000))
    assert make_batch_invariant(model, torch.float32, max_rows=128)
    assert type(model[0]) is SwitchingLinear


def test_probe_covers_each_step_size_and_kernel_switch_points() -> None:
    counts = probe_row_counts(512)
    assert counts[:33] == list(range(1, 34))
    assert {63, 64, 65, 127, 128, 129, 255, 256, 257, 511, 512} <= set(counts)
    assert max(counts) == 512 and max(probe_row_counts(100)) == 100


def test_bounds_keep_the_layer_output() -> None:
    torch.manual_seed(2)
    linear = nn.Linear(16, 8)
    x = torch.randn(11, 16)
    bounded = RowBounded(linear, RowBounds(min_rows=4, max_rows=5))
    torch.testing.assert_close(bounded(x), linear(x))
    torch.testing.assert_close(bounded(x[:2]), linear(x[:2]))
    assert bounded(x).shape == (11, 8) and bounded(x[:2]).shape == (2, 8)
