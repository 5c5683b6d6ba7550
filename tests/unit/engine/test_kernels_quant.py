"""INT8 / INT4 matmul kernels against their torch references (Triton under the interpreter)."""

from __future__ import annotations

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from engine.kernels import int4_mm, int8_mm

torch.set_num_threads(1)


@pytest.fixture
def interpreted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the Triton kernels (and the device functions they call) on CPU tensors, whatever
    TRITON_INTERPRET was at import time."""
    jitted = ((int8_mm, "_int8_mm_kernel"), (int4_mm, "_int4_mm_kernel"), (int4_mm, "_dequantize"))
    for module, name in jitted:
        kernel = getattr(module, name)
        if not isinstance(kernel, InterpretedFunction):
            monkeypatch.setattr(module, name, InterpretedFunction(kernel.fn))


def _int4_operands(n: int, k: int, group_size: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen)
    scales_and_zeros = torch.rand(k // group_size, n, 2, generator=gen) * 0.1 - 0.02
    return int4_mm.pack_int4(codes), scales_and_zeros.to(dtype), codes


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


@pytest.mark.parametrize("n,k", [(64, 32), (192, 96), (128, 576)])
def test_int4_pack_round_trip(n: int, k: int) -> None:
    codes = torch.randint(0, 16, (n, k))
    assert torch.equal(int4_mm.unpack_int4(int4_mm.pack_int4(codes)), codes.to(torch.uint8))


@pytest.mark.skipif(
    not int4_mm.cpu_op_uses_tile64(),
    reason="this CPU's int4 op packs another layout (no AVX-512): the fast path is off and "
    "int4_mm_cpu takes the reference, which test_int4_cpu_path_matches_reference covers",
)
def test_int4_layout_is_the_cpu_ops_layout() -> None:
    """The fast path leans on this: where torch packs our layout, the op reads our weights."""
    codes = torch.randint(0, 16, (192, 64), dtype=torch.int32)
    theirs = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
    assert torch.equal(theirs, int4_mm.pack_int4(codes))


def test_int4_dequantize_matches_the_definition() -> None:
    packed, sz, codes = _int4_operands(128, 96, 32, torch.float32)
    scales = sz[..., 0].t().repeat_interleave(32, dim=1)  # [N, K]
    zeros = sz[..., 1].t().repeat_interleave(32, dim=1)
    expected = (codes.float() - 8) * scales + zeros
    torch.testing.assert_close(int4_mm.int4_dequantize(packed, sz, 32, torch.float32), expected)


@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_cpu_path_matches_reference(rows: int, dtype: torch.dtype) -> None:
    packed, sz, _ = _int4_operands(192, 128, 64, dtype)
    x = torch.randn(rows, 128).to(dtype)
    expected = int4_mm.int4_mm_reference(x.float(), packed, sz.float(), 64)
    assert _rel_err(int4_mm.int4_mm_cpu(x, packed, sz, 64), expected) < 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_cpu_path_takes_a_view(dtype: torch.dtype) -> None:
    """The packed op refuses a strided input (a bf16 INT4 engine failed every request on
    it): the path computes a view's rows like a copy's."""
    packed, sz, _ = _int4_operands(192, 128, 64, dtype)
    x = torch.randn(128, 2).to(dtype).t()  # [2, 128], not contiguous
    expected = int4_mm.int4_mm_reference(x.float(), packed, sz.float(), 64)
    assert _rel_err(int4_mm.int4_mm_cpu(x, packed, sz, 64), expected) < 2e-2


@pytest.mark.parametrize("rows", [1, 3, 17, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_cpu_path_matches_reference(rows: int, dtype: torch.dtype) -> None:
    qweight = torch.randint(-128, 128, (96, 80), dtype=torch.int8)
    scales = torch.rand(96) * 0.01
    x = torch.randn(rows, 80).to(dtype)
    expected = int8_mm.int8_mm_reference(x.float(), qweight, scales)
    assert _rel_err(int8_mm.int8_mm_cpu(x, qweight, scales.to(dtype)), expected) < 2e-2


def test_int8_cpu_path_falls_back_when_k_is_not_a_multiple_of_16() -> None:
    """The packed op returns NaN or crashes in bf16 for such K (seen with torch 2.13)."""
    qweight = torch.randint(-128, 128, (64, 72), dtype=torch.int8)
    scales = (torch.rand(64) * 0.01).bfloat16()
    x = torch.randn(2, 72).bfloat16()
    assert torch.isfinite(int8_mm.int8_mm_cpu(x, qweight, scales)).all()


def _misaligned(tensor: torch.Tensor, offset_bytes: int = 8) -> torch.Tensor:
    raw = torch.empty(tensor.numel() * tensor.element_size() + 128, dtype=torch.uint8)
    start = (64 - raw.data_ptr() % 64) % 64 + offset_bytes
    view = raw[start : start + tensor.numel() * tensor.element_size()]
    return view.view(tensor.dtype).view(tensor.shape).copy_(tensor)


@pytest.mark.parametrize("rows", [1, 4])
def test_int8_cpu_path_survives_misaligned_tensors(rows: int) -> None:
    """The packed op segfaults on 8-byte aligned operands (seen with torch 2.13)."""
    qweight = torch.randint(-128, 128, (960, 576), dtype=torch.int8)
    scales = (torch.rand(960) * 0.01).bfloat16()
    x = torch.randn(rows, 576).bfloat16()
    expected = int8_mm.int8_mm_reference(x.float(), qweight, scales.float())
    actual = int8_mm.int8_mm_cpu(_misaligned(x), _misaligned(qweight), scales)
    assert _rel_err(actual, expected) < 2e-2


@pytest.mark.parametrize("m,n,k", [(1, 64, 32), (5, 100, 72), (17, 67, 99)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_triton_matches_reference(interpreted, m: int, n: int, k: int, dtype) -> None:
    qweight = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    scales = torch.rand(n) * 0.01
    x = torch.randn(m, k).to(dtype)
    expected = int8_mm.int8_mm_reference(x.float(), qweight, scales)
    actual = int8_mm.int8_mm_triton(x, qweight, scales.to(dtype))
    assert actual.dtype == dtype
    assert _rel_err(actual, expected) < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize(
    "m,n,k,group_size", [(1, 64, 32, 32), (5, 192, 96, 32), (17, 128, 256, 128)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_triton_matches_reference(interpreted, m, n, k, group_size, dtype) -> None:
    packed, sz, _ = _int4_operands(n, k, group_size, dtype)
    x = torch.randn(m, k).to(dtype)
    expected = int4_mm.int4_mm_reference(x.float(), packed, sz.float(), group_size)
    actual = int4_mm.int4_mm_triton(x, packed, sz, group_size)
    assert actual.dtype == dtype
    assert _rel_err(actual, expected) < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 64, 300])
def test_triton_kernels_on_gpu(m: int) -> None:
    packed, sz, _ = _int4_operands(3072, 576, 64, torch.bfloat16)
    x = torch.randn(m, 576, dtype=torch.bfloat16)
    expected = int4_mm.int4_mm_reference(x.float(), packed, sz.float(), 64)
    actual = int4_mm.int4_mm_triton(x.cuda(), packed.cuda(), sz.cuda(), 64).cpu()
    assert _rel_err(actual, expected) < 2e-2
    qweight = torch.randint(-128, 128, (960, 576), dtype=torch.int8)
    scales = torch.rand(960) * 0.01
    expected = int8_mm.int8_mm_reference(x.float(), qweight, scales)
    actual = int8_mm.int8_mm_triton(x.cuda(), qweight.cuda(), scales.bfloat16().cuda()).cpu()
    assert _rel_err(actual, expected) < 2e-2
