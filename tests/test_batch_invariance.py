"""Linear layers padded to a batch-invariant row count: rows agree bit for bit."""

from __future__ import annotations

import torch
from torch import nn

from engine.model.batch_invariance import RowPadded, make_batch_invariant, min_invariant_rows


def test_every_linear_is_wrapped_and_its_rows_no_longer_depend_on_the_batch() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 384), nn.ReLU(), nn.Linear(384, 96))
    x = torch.randn(40, 96)
    assert make_batch_invariant(model, torch.float32)
    assert [type(m) for m in model] == [RowPadded, nn.ReLU, RowPadded]
    assert all(m.min_rows == min_invariant_rows(m.linear, torch.float32)
               for m in model if isinstance(m, RowPadded))  # fmt: skip
    with torch.inference_mode():
        full = model(x)
        for num_rows in (1, 2, 3, 5, 7, 9, 11, 13, 33):
            assert torch.equal(model(x[:num_rows]), full[:num_rows]), num_rows
            assert torch.equal(model(x[7 : 7 + num_rows]), full[7 : 7 + num_rows]), num_rows


def test_padding_keeps_the_layer_output() -> None:
    torch.manual_seed(1)
    linear = nn.Linear(16, 8)
    x = torch.randn(2, 16)
    torch.testing.assert_close(RowPadded(linear, 4)(x), linear(x))
    assert RowPadded(linear, 4)(x).shape == (2, 8)
