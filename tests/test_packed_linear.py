"""PackedLinear is a drop-in for a bf16 nn.Linear on CPU: same results, any batch size."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.model.packed_linear import PackedLinear, can_pack, pack_linears

pytestmark = pytest.mark.skipif(
    not can_pack("cpu", torch.bfloat16), reason="this CPU's oneDNN has no bf16 kernels"
)


@pytest.mark.parametrize("rows", [1, 3, 64, 257])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(576, 960, bias=bias).to(torch.bfloat16)
    x = torch.randn(rows, 576, dtype=torch.bfloat16)
    with torch.inference_mode():
        torch.testing.assert_close(PackedLinear(linear)(x), linear(x), rtol=1e-2, atol=1e-2)


def test_pack_linears_swaps_only_plain_linears() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).to(torch.bfloat16)
    pack_linears(model)
    assert [type(m) for m in model] == [PackedLinear, nn.ReLU, PackedLinear]


def test_fp32_and_other_devices_are_left_alone() -> None:
    assert not can_pack("cpu", torch.float32)
    assert not can_pack("cuda", torch.bfloat16)
