"""FP8 checkpoints computed from their codes: each projection reads one byte a weight.

A checkpoint's e4m3 weights and scales (engine/model/fp8_weights.py reads both hub
layouts) become `Fp8Linear` layers over the CPU kernel (engine/kernels/fp8_mm.py), fused
like dense weights (q/k/v, gate/up concatenate their rows and their rows' scales). At a
decode step's few rows a matmul waits on its weight reads, and these are half of bf16's.
Where the kernel is not built here (no compiler, a CPU without AVX2 / F16C, a GPU), the
model is split over tensor-parallel ranks, or a layer's shape does not fit its blocking,
the weights are expanded to the model's dtype at load instead: the same numbers, read at
full width.

The scales stay fp32 whatever the model's dtype (a bf16 scale would move every weight of
its row by up to 2^-9): the loader puts the model's other tensors in its dtype itself.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from engine.config import EngineConfig
from engine.kernels.fp8_mm import NATIVE, dequantize
from engine.model.args import ModelArgs
from engine.model.fp8_weights import Fp8Weights
from engine.model.hf_names import engine_state_dict
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import read_safetensors
from engine.quant.linear import QuantLinear, set_submodule

PARTS = ("fp8_codes", "fp8_scales")
"""A layer's tensors between the checkpoint and the kernel's layout (Fp8Weights)."""


class Fp8Linear(QuantLinear):
    """e4m3 codes in the kernel's blocks and fp32 scales per output row and input group."""

    codes: torch.Tensor
    scales: torch.Tensor

    def __init__(self, in_features: int, out_features: int, groups: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias, torch.float32, None)
        rows = NATIVE.rows_per_block()
        blocks = out_features // rows
        self.register_buffer("codes", torch.empty(blocks, in_features, rows, dtype=torch.int8))
        self.register_buffer("scales", torch.empty(blocks, groups, rows, dtype=torch.float32))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] @ W^T, the codes decoded in registers."""
        return NATIVE.matmul(x, self.codes, self.scales)

    def dequantized_weight(self) -> torch.Tensor:
        """The [N, K] float weight this module computes with."""
        return dequantize(*NATIVE.unpack(self.codes, self.scales))

    def use_int8_activations(self) -> None:
        """FP8 layers compute with float activations only."""
        raise ValueError("an FP8 layer takes no int8 activations")

    def takes_int8_activations(self) -> bool:
        """Never: see use_int8_activations."""
        return False

    def extra_repr(self) -> str:
        """Shapes and scheme, for printing the model."""
        shapes = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{shapes}, fp8 e4m3, {self.scales.shape[1]} scale groups"


def computes_fp8(config: EngineConfig) -> bool:
    """FP8 layers run here: a CPU engine on one rank (tensor parallelism splits dense
    weights: its ranks load FP8 expanded) where the kernel builds."""
    on_cpu = torch.device(config.device).type == "cpu"
    return on_cpu and config.tensor_parallel_size == 1 and NATIVE.available()


def load_fp8(
    model_dir: Path, args: ModelArgs, config: EngineConfig, fmt: Fp8Weights
) -> LlamaForCausalLM:
    """The model with its checkpoint's FP8 projections as Fp8Linear layers, the rest (and
    layers the kernel cannot block) in the model's dtype."""
    with torch.device("meta"):
        model = LlamaForCausalLM(args)
    state = engine_state_dict(fmt.codes_and_row_scales(read_safetensors(model_dir)), args)
    fp32_scales = swap_in_fp8(model, state)
    dtype = config.torch_dtype
    model.load_engine_state({
        name: t.to(dtype) if t.is_floating_point() and name not in fp32_scales else t
        for name, t in state.items()
    })  # fmt: skip
    return model.to(device=config.device).eval()


def swap_in_fp8(model: nn.Module, state: dict[str, torch.Tensor]) -> set[str]:
    """Turn each fused layer's PARTS in `state` into an Fp8Linear's tensors (a meta-device
    module put in the model, filled when the state loads), or a dense weight where the
    kernel cannot block the layer's shape; the names of the scales, kept in fp32."""
    scale_names = set()
    for name in [n for n in state if n.endswith(f".{PARTS[0]}")]:
        layer = name.removesuffix(f".{PARTS[0]}")
        codes, scales = (state.pop(f"{layer}.{part}") for part in PARTS)
        (n, k), groups = codes.shape, scales.shape[1]
        if not NATIVE.supports(n, k, k // groups):
            state[f"{layer}.weight"] = dequantize(codes, scales)
            continue
        with torch.device("meta"):
            set_submodule(model, layer, Fp8Linear(k, n, groups, f"{layer}.bias" in state))
        state[f"{layer}.codes"], state[f"{layer}.scales"] = NATIVE.repack(codes, scales)
        scale_names.add(f"{layer}.scales")
    return scale_names
