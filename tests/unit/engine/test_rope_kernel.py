"""The rotary-embedding kernel (engine/kernels/rope.c) against torch's rotation, bit for
bit, and the cases it leaves to torch."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import rope
from engine.model.llama import rotate

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
pytestmark = pytest.mark.skipif(rope._lib() is None, reason="no C compiler here")


def _qkv_and_rotation(rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, tuple]:
    """A fused projection's output [rows, (H + 2 KVH) D] and cos/sin [rows, 1, D]."""
    generator = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=generator) * 4
    angles = torch.rand(rows, 1, HEAD_DIM // 2, generator=generator) * 1000
    angles = torch.cat([angles, angles], dim=-1)
    return qkv.to(dtype), (angles.cos().to(dtype), angles.sin().to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_kernel_rotates_q_and_k_as_torch_does_to_the_bit(rows: int, dtype: torch.dtype) -> None:
    qkv, rotation = _qkv_and_rotation(rows, dtype)
    q_end, k_end = HEADS * HEAD_DIM, (HEADS + KV_HEADS) * HEAD_DIM
    expected_q = rotate(qkv[:, :q_end].reshape(rows, HEADS, HEAD_DIM), rotation)
    expected_k = rotate(qkv[:, q_end:k_end].reshape(rows, KV_HEADS, HEAD_DIM), rotation)
    v_before = qkv[:, k_end:].clone()

    assert rope.rotate_in_place(qkv, *rotation, HEADS + KV_HEADS, HEAD_DIM)

    assert torch.equal(qkv[:, :q_end].view(rows, HEADS, HEAD_DIM), expected_q)
    assert torch.equal(qkv[:, q_end:k_end].view(rows, KV_HEADS, HEAD_DIM), expected_k)
    assert torch.equal(qkv[:, k_end:], v_before)


def test_other_dtypes_and_autograd_are_left_to_torch() -> None:
    qkv, rotation = _qkv_and_rotation(4, torch.float16)
    before = qkv.clone()
    assert not rope.rotate_in_place(qkv, *rotation, HEADS + KV_HEADS, HEAD_DIM)
    assert torch.equal(qkv, before)

    tracked, rotation = _qkv_and_rotation(4, torch.float32)
    tracked.requires_grad_()
    assert not rope.rotate_in_place(tracked, *rotation, HEADS + KV_HEADS, HEAD_DIM)


def test_an_odd_head_dim_is_refused() -> None:
    qkv, (cos, sin) = _qkv_and_rotation(2, torch.float32)
    with pytest.raises(ValueError, match="head_dim"):
        rope.rotate_in_place(qkv, cos[..., :63], sin[..., :63], 1, 63)
