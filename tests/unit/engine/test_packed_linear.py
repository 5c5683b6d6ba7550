"""PackedLinear is a drop-in for an nn.Linear on CPU: same results, any batch size."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.model.packed_linear import PackedLinear, can_pack, pack_linears

DTYPES = {
    torch.float32: 1e-5,
    torch.bfloat16: 1e-2,
}
"""Each dtype oneDNN packs on this CPU, with the tolerance against F.linear."""


def _packable(dtype: torch.dtype):
    return pytest.param(
        dtype, marks=pytest.mark.skipif(not can_pack("cpu", dtype), reason=f"no oneDNN {dtype}")
    )


@pytest.mark.parametrize("dtype", [_packable(d) for d in DTYPES])
@pytest.mark.parametrize("rows", [1, 3, 64, 257])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_linear(rows: int, bias: bool, dtype: torch.dtype) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(576, 960, bias=bias).to(dtype)
    x = torch.randn(rows, 576, dtype=dtype)
    tolerance = DTYPES[dtype]
    with torch.inference_mode():
        torch.testing.assert_close(
            PackedLinear(linear)(x), linear(x), rtol=tolerance, atol=tolerance
        )


@pytest.mark.parametrize("dtype", [_packable(d) for d in DTYPES])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    packed = PackedLinear(nn.Linear(576, 960).to(dtype))
    x = torch.randn(80, 576, dtype=dtype)
    with torch.inference_mode():
        full = packed(x)
        for rows in (1, 2, 3, 5, 7, 11, 17, 33):
            assert torch.equal(packed(x[:rows]), full[:rows]), rows


def test_pack_linears_swaps_only_plain_linears() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    pack_linears(model)
    assert [type(m) for m in model] == [PackedLinear, nn.ReLU, PackedLinear]


def test_other_devices_and_dtypes_are_left_alone() -> None:
    assert not can_pack("cuda", torch.bfloat16)
    assert not can_pack("cpu", torch.float16)
