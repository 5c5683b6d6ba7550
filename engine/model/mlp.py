"""The SwiGLU feed-forward: the dense layer's MLP, and each expert of a sparse one."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.silu_mul import silu_mul


def _gelu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh").mul_(up)


GATED_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": silu_mul,  # in one pass where the kernel applies
    "gelu_pytorch_tanh": _gelu_mul,
}
"""act(gate) * up of rows [T, 2 * intermediate] laid out as [gate | up], by the gate's
activation's config.json name: SwiGLU (Llama and most) or GeGLU (Gemma)."""


class MLP(nn.Module):
    """SwiGLU feed-forward with one fused gate/up projection (one matmul instead of two:
    at batch 1 on a CPU the per-call overhead of small matmuls is not free)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool = False, act: str = "silu"
    ) -> None:
        super().__init__()
        if act not in GATED_ACTIVATIONS:
            supported = ", ".join(GATED_ACTIVATIONS)
            raise ValueError(f"activation {act!r} is not supported ({supported} are)")
        self.gated_act = GATED_ACTIVATIONS[act]
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """down(act(gate(x)) * up(x)) for rows x [T, hidden]."""
        return self.down_proj(self.gated_act(self.gate_up_proj(x)))
