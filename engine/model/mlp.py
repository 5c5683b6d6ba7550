"""The SwiGLU feed-forward: the dense layer's MLP, and each expert of a sparse one."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": partial(F.silu, inplace=True),  # in the fresh projection
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
}
"""The gate's activation by its config.json name: SwiGLU (Llama and most) or GeGLU (Gemma)."""


class MLP(nn.Module):
    """SwiGLU feed-forward with one fused gate/up projection (one matmul instead of two:
    at batch 1 on a CPU the per-call overhead of small matmuls is not free)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool = False, act: str = "silu"
    ) -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"activation {act!r} is not supported ({', '.join(ACTIVATIONS)} are)")
        self.act = ACTIVATIONS[act]
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """down(act(gate(x)) * up(x)) for rows x [T, hidden]."""
        gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate]
        gate, up = gate_up[..., : self.intermediate_size], gate_up[..., self.intermediate_size :]
        return self.down_proj(self.act(gate).mul_(up))
