"""The SwiGLU kernel (engine/kernels/silu_mul.c) against torch's silu and product, bit for
bit, and the inputs it leaves to torch."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import silu_mul as kernel
from testing.engine_helpers import on_one_and_two_threads

pytestmark = pytest.mark.skipif(kernel._lib() is None, reason="no C compiler here")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A bf16 tensor's bits, so NaNs compare too."""
    return t.view(torch.int16)


def test_every_bf16_gate_value_gives_torchs_bits() -> None:
    """All 65,536 bf16 gate values (NaNs and infinities included) beside random ups."""
    gates = torch.arange(2**16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gates = gates.reshape(64, 1024)
    ups = (torch.randn(64, 1024, generator=torch.Generator().manual_seed(0)) * 4).bfloat16()
    gate_up = torch.cat([gates, ups], dim=1)

    out = kernel.silu_mul(gate_up)

    assert out.shape == (64, 1024) and out.is_contiguous()
    assert torch.equal(_bits(out), _bits(kernel.silu_mul_reference(gate_up.clone())))


@pytest.mark.parametrize("rows, width", [(1, 1536), (16, 1536), (5, 77)])
def test_rows_match_torch_and_do_not_depend_on_the_batch(rows: int, width: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * width, generator=generator) * 3).bfloat16()

    out = kernel.silu_mul(gate_up)

    assert torch.equal(_bits(out), _bits(kernel.silu_mul_reference(gate_up.clone())))
    last = kernel.silu_mul(gate_up[rows - 1 :].contiguous())
    assert torch.equal(_bits(last), _bits(out[rows - 1 :]))


def test_fp32_and_strided_rows_keep_to_torch() -> None:
    gate_up = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    assert torch.equal(kernel.silu_mul(gate_up.clone()), kernel.silu_mul_reference(gate_up))

    strided = gate_up.bfloat16()[:, ::2]  # [4, 32] with every other column
    expected = kernel.silu_mul_reference(strided.contiguous())
    assert torch.equal(_bits(kernel.silu_mul(strided)), _bits(expected))


def test_many_rows_split_over_threads_without_changing_a_bit() -> None:
    gate_up = (torch.randn(64, 3072, generator=torch.Generator().manual_seed(2)) * 3).bfloat16()
    alone, split = on_one_and_two_threads(lambda: kernel.silu_mul(gate_up))
    assert torch.equal(_bits(alone), _bits(split))
    assert torch.equal(_bits(split), _bits(kernel.silu_mul_reference(gate_up.clone())))
