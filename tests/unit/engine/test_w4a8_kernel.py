"""The W4A8 and W8A8 CPU kernels (engine/kernels/w4a8.c) against their float64 torch
references, their batch invariance, and the quantized layers that switch to them."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch

from engine.config import QuantConfig
from engine.kernels import w4a8
from engine.kernels.int4_mm import int4_mm_reference, pack_int4
from engine.quant.linear import Int4Linear, Int8Linear, quantize_linear, switch_to_int8_activations
from engine.quant.maths import quantize_int8
from testing.engine_helpers import on_one_and_two_threads

pytestmark = pytest.mark.skipif(not w4a8.available(), reason="no AVX2 / C compiler here")

SHAPES = [(64, 64, 32), (192, 576, 64), (1536, 576, 32), (576, 1536, 128)]
"""(N, K, group): the model's projections, and the smallest block the kernel takes."""
KINDS = ("int4", "int8")
"""W4A8 and W8A8."""
Reference = Callable[[torch.Tensor], torch.Tensor]


def _int4_weight(n: int, k: int, group: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=generator)
    scales = torch.rand(k // group, n, generator=generator) * 0.02 + 1e-3
    zeros = torch.randn(k // group, n, generator=generator) * 0.01
    return pack_int4(codes), torch.stack([scales, zeros], dim=-1)


def _int8_weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    codes, scales = quantize_int8(torch.randn(n, k, generator=generator))
    codes[:, :3] = -128  # reachable with AWQ's clip; its magnitude does not fit an int8
    return codes, scales


def _case(kind: str, n: int, k: int, group: int) -> tuple[w4a8.A8Weight, Reference]:
    """A random weight of `kind` in the kernel's layout, and the float64 reference for it."""
    if kind == "int4":
        packed, scales_and_zeros = _int4_weight(n, k, group)
        return w4a8.repack(packed, scales_and_zeros, group), functools.partial(
            w4a8.w4a8_mm_reference, packed=packed, scales_and_zeros=scales_and_zeros,
            group_size=group,
        )  # fmt: skip
    codes, scales = _int8_weight(n, k)
    reference = functools.partial(
        w4a8.w8a8_mm_reference, qweight=codes, scales=scales, group_size=group
    )
    return w4a8.repack_int8(codes, scales, group), reference


@pytest.mark.skipif(not w4a8.uses_vnni(), reason="this CPU has no VNNI: one path only")
@pytest.mark.parametrize("kind", KINDS)
def test_vnni_and_avx2_paths_agree_bit_for_bit(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    weight, _ = _case(kind, 576, 1536, 64)
    x = torch.randn(9, 1536) * 3
    x[0, :64] = 0.0  # a group of zero activations
    vnni = w4a8.a8_mm(x, weight)

    avx2_library = w4a8._library(w4a8.WITHOUT_VNNI_FLAGS)
    monkeypatch.setattr(w4a8, "_library", lambda: avx2_library)
    assert not w4a8.uses_vnni()
    assert w4a8.rows_per_block() == 8  # 256-bit registers: its own layout
    avx2_weight, _ = _case(kind, 576, 1536, 64)  # the same weight, repacked for it

    assert torch.equal(w4a8.a8_mm(x, avx2_weight), vnni)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("n", "k", "group"), SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 64])
def test_kernel_matches_its_reference(kind: str, n: int, k: int, group: int, rows: int) -> None:
    weight, reference_mm = _case(kind, n, k, group)
    x = torch.randn(rows, k) * 3

    out = w4a8.a8_mm(x, weight)

    reference = reference_mm(x)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())


def test_int8_activations_stay_close_to_float_ones() -> None:
    """What W4A8 trades: per-group int8 activations move outputs by well under 1% here."""
    packed, scales_and_zeros = _int4_weight(576, 1536, 64)
    x = torch.randn(8, 1536)

    out = w4a8.a8_mm(x, w4a8.repack(packed, scales_and_zeros, 64))

    weight_only = int4_mm_reference(x, packed, scales_and_zeros, 64)
    relative = (out - weight_only).norm() / weight_only.norm()
    assert 0 < relative < 0.01


@pytest.mark.parametrize("kind", KINDS)
def test_a_row_is_the_same_alone_or_in_any_batch(kind: str) -> None:
    weight, _ = _case(kind, 1536, 576, 64)
    x = torch.randn(13, 576)

    batch = w4a8.a8_mm(x, weight)

    for rows in (1, 2, 3, 5):  # every tile size the kernel has, and their mixes
        parts = [w4a8.a8_mm(x[i : i + rows], weight) for i in range(0, 13, rows)]
        assert torch.equal(torch.cat(parts), batch)


@pytest.mark.parametrize("kind", KINDS)
def test_threads_split_the_outputs_without_changing_a_bit(kind: str) -> None:
    weight, _ = _case(kind, 1536, 576, 64)
    x = torch.randn(4, 576)
    alone, split = on_one_and_two_threads(lambda: w4a8.a8_mm(x, weight))
    assert torch.equal(alone, split)


def test_zero_and_bf16_inputs() -> None:
    packed, scales_and_zeros = _int4_weight(64, 64, 32)
    weight = w4a8.repack(packed, scales_and_zeros, 32)

    zero_rows = w4a8.a8_mm(torch.zeros(2, 64), weight)
    halves = w4a8.a8_mm(torch.randn(3, 64).bfloat16(), weight)

    assert torch.equal(zero_rows, torch.zeros(2, 64))  # a zero group has scale 0, not NaN
    assert halves.dtype == torch.bfloat16 and torch.isfinite(halves.float()).all()


@pytest.mark.parametrize(("scheme", "group"), [("int4", 64), ("int8", 0)])
def test_a_layer_switched_to_int8_activations_computes_with_its_kernel(
    scheme: str, group: int
) -> None:
    torch.manual_seed(0)
    layer = quantize_linear(torch.nn.Linear(576, 192, bias=False), scheme, group)
    x = torch.randn(5, 576)
    weight_only = layer(x)

    assert switch_to_int8_activations(torch.nn.Sequential(layer)) == 1
    switched = layer(x)

    if isinstance(layer, Int4Linear):
        expected = w4a8.w4a8_mm_reference(x, layer.qweight, layer.scales_and_zeros, 64)
    else:
        assert isinstance(layer, Int8Linear)
        expected = w4a8.w8a8_mm_reference(x, layer.qweight, layer.scales, 64)
    torch.testing.assert_close(switched, expected, rtol=1e-5, atol=1e-5)
    relative = (switched - weight_only).norm() / weight_only.norm()
    assert 0 < relative < 0.01
    assert "a8_weight" not in dict(layer.named_buffers())  # the checkpoint is unchanged


def test_repack_refuses_shapes_the_kernel_cannot_block() -> None:
    packed, scales_and_zeros = _int4_weight(64, 576, 64)
    with pytest.raises(ValueError, match="W4A8"):
        w4a8.repack(packed, scales_and_zeros, 128)  # 576 inputs are not groups of 128


def test_quant_config_refuses_unknown_activations_and_int8_layers_outside_int4() -> None:
    with pytest.raises(ValueError, match="quant.activations"):
        QuantConfig("int4", activations="fp8")
    with pytest.raises(ValueError, match="needs 'int4'"):
        QuantConfig("int8", int8_layers=("down_proj",))
    with pytest.raises(ValueError, match="quantize_lm_head"):
        QuantConfig("int4", int8_layers=("lm_head",))
    assert QuantConfig("int4", int8_layers=["down_proj"]).int8_layers == ("down_proj",)
