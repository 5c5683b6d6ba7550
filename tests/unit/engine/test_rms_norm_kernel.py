"""The fused RMSNorm kernel (engine/kernels/rms_norm.c) against its torch reference, its
batch invariance, and the paths that keep to torch."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import rms_norm as kernel
from testing.engine_helpers import on_one_and_two_threads

EPS = 1e-5
pytestmark = pytest.mark.skipif(kernel._lib() is None, reason="no C compiler here")


DTYPES = (torch.float32, torch.bfloat16)


def _inputs(
    rows: int, dim: int = 576, seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    x, residual = (torch.randn(rows, dim, generator=generator) * 3 for _ in range(2))
    return x.to(dtype), residual.to(dtype), torch.randn(dim, generator=generator).to(dtype)


def _assert_matches(out: torch.Tensor, reference: torch.Tensor) -> None:
    """Close at the dtype's precision; in bf16 also the same value almost everywhere: the
    fp32 ulps by which a row's scale may differ move an element only where it rounds."""
    torch.testing.assert_close(out, reference)
    if out.dtype == torch.bfloat16:
        assert (out == reference).float().mean() > 0.99


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("dim", [576, 77])  # a multiple of the kernel's 8 lanes, and not
def test_kernel_matches_the_torch_reference(rows: int, dim: int, dtype: torch.dtype) -> None:
    x, residual, weight = _inputs(rows, dim, dtype=dtype)

    normed = kernel.rms_norm(x, weight, EPS)
    added, summed = kernel.add_rms_norm(x.clone(), residual.clone(), weight, EPS)

    assert normed.dtype == added.dtype == summed.dtype == dtype
    _assert_matches(normed, kernel.rms_norm_reference(x, weight, EPS))
    assert torch.equal(summed, residual + x)
    _assert_matches(added, kernel.rms_norm_reference(residual + x, weight, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_is_the_same_alone_or_in_a_batch(dtype: torch.dtype) -> None:
    x, residual, weight = _inputs(9, dtype=dtype)

    batch, batch_sum = kernel.add_rms_norm(x.clone(), residual.clone(), weight, EPS)

    for row in range(9):
        alone, alone_sum = kernel.add_rms_norm(
            x[row : row + 1].clone(), residual[row : row + 1].clone(), weight, EPS
        )
        assert torch.equal(alone, batch[row : row + 1]) and torch.equal(
            alone_sum, batch_sum[row : row + 1]
        )
    assert torch.equal(kernel.rms_norm(x[3:4], weight, EPS), kernel.rms_norm(x, weight, EPS)[3:4])


def test_the_fused_norm_works_in_place_and_keeps_leading_dims() -> None:
    """Where the kernel runs, the sum lands in `residual` and the norm in `x`: nothing is
    allocated, and the results are what a fresh computation gives."""
    x, residual, weight = _inputs(6)
    x3, residual3 = x.view(2, 3, -1), residual.view(2, 3, -1)
    expected_sum = residual3 + x3
    expected = kernel.rms_norm_reference(expected_sum, weight, EPS)

    normed, summed = kernel.add_rms_norm(x3, residual3, weight, EPS)

    assert normed.data_ptr() == x.data_ptr() and summed.data_ptr() == residual.data_ptr()
    assert normed.shape == summed.shape == (2, 3, 576)
    assert torch.equal(summed, expected_sum)
    _assert_matches(normed, expected)


def test_strided_inputs_keep_to_torch_and_are_left_untouched() -> None:
    x, residual, weight = _inputs(6, dim=1152)
    x_half, residual_half = x[:, ::2], residual[:, ::2]  # every other column: strided
    before = residual_half.clone(), x_half.clone()

    normed, summed = kernel.add_rms_norm(x_half, residual_half, weight[::2].clone(), EPS)

    assert torch.equal(summed, before[0] + before[1])
    assert torch.equal(residual_half, before[0]) and torch.equal(x_half, before[1])
    assert normed.shape == (6, 576)


def test_other_dtypes_and_autograd_keep_to_torch() -> None:
    x, residual, weight = _inputs(4)
    halves = kernel.rms_norm(x.half(), weight.half(), EPS)
    assert torch.equal(halves, kernel.rms_norm_reference(x.half(), weight.half(), EPS))
    mixed = kernel.rms_norm(x.bfloat16(), weight, EPS)  # fp32 weight, bf16 rows
    assert torch.equal(mixed, kernel.rms_norm_reference(x.bfloat16(), weight, EPS))

    trained = weight.clone().requires_grad_()
    kernel.add_rms_norm(x, residual, trained, EPS)[0].sum().backward()
    assert trained.grad is not None and torch.isfinite(trained.grad).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_many_rows_split_over_threads_without_changing_a_bit(dtype: torch.dtype) -> None:
    x, residual, weight = _inputs(64, dtype=dtype)

    def both_norms() -> tuple[torch.Tensor, ...]:
        normed = kernel.rms_norm(x, weight, EPS)
        return (normed, *kernel.add_rms_norm(x.clone(), residual.clone(), weight, EPS))

    alone, split = on_one_and_two_threads(both_norms)
    assert all(torch.equal(a, b) for a, b in zip(alone, split, strict=True))
