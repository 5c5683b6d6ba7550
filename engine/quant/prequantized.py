"""Checkpoints quantized elsewhere: AutoAWQ's and GPTQ's INT4 layouts, loaded as they are.

Teams download these for cheap serving; re-quantizing them would lose what their
quantizer found. Both store, per linear layer, 4-bit codes `q`, a 4-bit zero
point `z` and a scale `s` per group of input channels, with w = (q - z) * s. The
engine's INT4 layer computes w = (code - 8) * scale + zero, so a layer converts
exactly: code = q, scale = s, zero = (8 - z) * s. What differs is the packing:

- GPTQ (`checkpoint_format` "gptq", as transformers and AutoGPTQ write it):
  `qweight` int32 [K / 8, N], eight codes of consecutive input channels per
  word, lowest nibble first; `qzeros` int32 [G, N / 8], zero points minus one,
  eight output channels per word; `scales` [G, N]; `g_idx` [K], each input
  channel's group (act-order checkpoints, `desc_act`, permute it: refused).
- AutoAWQ's GEMM version: `qweight` int32 [K, N / 8] and `qzeros` int32
  [G, N / 8], eight output channels per word in the interleaved order
  AWQ_ORDER; `scales` [G, N].

Each layer's parts are renamed and fused (q/k/v, gate/up) like dense weights
(engine/model/hf_names.py concatenates output rows), then packed into the engine's
INT4 layout. A fused layer whose output width the INT4 kernel cannot tile is
dequantized into a dense weight instead: the same numbers, computed as floats.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engine.config import EngineConfig
from engine.kernels.int4_mm import TILE_N, pack_int4
from engine.model.args import ModelArgs
from engine.model.fp8_weights import FP8_METHODS
from engine.model.hf_names import engine_state_dict
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import read_safetensors
from engine.quant.linear import Int4Linear, set_submodule

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""Output channel (within a word's eight) held by each nibble of an AWQ word, low first."""
PARTS = ("int4_codes", "int4_scales", "int4_zeros")
"""Each quantized layer's tensors between conversion and packing, output channels first
(so that fusing projections concatenates them like weights): codes [N, K], and scales
and zeros [N, G]."""
GROUP_SIZES = (32, 64, 128)
"""Group sizes the INT4 kernels take."""


@dataclass(frozen=True)
class HubInt4:
    """A checkpoint's INT4 format, from its config.json's `quantization_config`."""

    method: str
    """`awq` or `gptq`."""
    group_size: int

    @classmethod
    def from_hf_config(cls, hf_config: dict) -> HubInt4 | None:
        """The format of a pre-quantized checkpoint; None for a plain one; ValueError naming
        the setting for one the engine does not load."""
        quant = hf_config.get("quantization_config")
        if quant is None or quant.get("quant_method") in FP8_METHODS:  # dense at load
            return None
        method = quant.get("quant_method")
        if method not in ("awq", "gptq"):
            raise ValueError(
                f"quantization_config.quant_method {method!r} is not loaded: "
                f"'awq', 'gptq' and {' and '.join(map(repr, FP8_METHODS))} are"
            )
        _require(quant, "bits", 4)
        if method == "awq":
            _require(quant, "version", "gemm", case_free=True)
            _require(quant, "zero_point", True)
        else:
            _require(quant, "desc_act", False)
            _require(quant, "checkpoint_format", "gptq")
        group_size = quant.get("group_size", quant.get("q_group_size"))
        if group_size not in GROUP_SIZES:
            raise ValueError(
                f"quantization_config.group_size {group_size!r} is not loaded: one of {GROUP_SIZES}"
            )
        return cls(method, group_size)


def _require(quant: dict, key: str, expected: object, case_free: bool = False) -> None:
    value = quant.get(key, expected)
    if case_free and isinstance(value, str):
        value = value.lower()
    if value != expected:
        raise ValueError(f"quantization_config.{key} {value!r} is not loaded: only {expected!r}")


def load_prequantized(
    model_dir: Path, args: ModelArgs, config: EngineConfig, fmt: HubInt4
) -> LlamaForCausalLM:
    """The model with its checkpoint's INT4 layers as the engine's, the rest dense."""
    with torch.device("meta"):
        model = LlamaForCausalLM(args)
    state = engine_state_dict(unpacked_state(read_safetensors(model_dir), fmt), args)
    swap_in_int4(model, state, fmt.group_size)
    model.load_engine_state(state)
    return model.to(device=config.device, dtype=config.torch_dtype).eval()


def unpacked_state(hf_state: dict[str, torch.Tensor], fmt: HubInt4) -> dict[str, torch.Tensor]:
    """The checkpoint with each quantized layer's packed tensors replaced by its PARTS."""
    state = dict(hf_state)
    for name in [n for n in hf_state if n.endswith(".qweight")]:
        layer = name.removesuffix(".qweight")
        packed = [state.pop(f"{layer}.{part}") for part in ("qweight", "qzeros", "scales")]
        g_idx = state.pop(f"{layer}.g_idx", None)
        unpack = _unpack_awq if fmt.method == "awq" else _unpack_gptq
        codes, zeros = unpack(packed[0], packed[1])
        if g_idx is not None:
            _check_groups(g_idx, fmt.group_size, layer)
        scales = packed[2].float()
        parts = (codes, scales.t(), ((8 - zeros.float()) * scales).t())
        state.update({f"{layer}.{part}": tensor for part, tensor in zip(PARTS, parts, strict=True)})
    return state


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> uint8 [..., W, 8], each word's nibbles, lowest first."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((words.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8)


def _unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [N, K] and zero points [G, N] of a GPTQ layer (zeros are stored minus one)."""
    packed_k, n = qweight.shape
    codes = _nibbles(qweight).permute(1, 0, 2).reshape(n, packed_k * 8)  # [N, K/8, 8]
    zeros = _nibbles(qzeros).flatten(1) + 1  # [G, N]
    return codes, zeros


def _unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [N, K] and zero points [G, N] of an AWQ layer (interleaved output channels)."""
    inverse = torch.tensor(AWQ_ORDER).argsort()  # nibble holding each output channel

    def channels(words: torch.Tensor) -> torch.Tensor:
        return _nibbles(words)[..., inverse].flatten(-2)  # [rows, N]

    return channels(qweight).t().contiguous(), channels(qzeros)


def _check_groups(g_idx: torch.Tensor, group_size: int, layer: str) -> None:
    """Groups of consecutive input channels, as the INT4 kernels read them."""
    expected = torch.arange(g_idx.numel(), dtype=g_idx.dtype) // group_size
    if not torch.equal(g_idx, expected):
        raise ValueError(f"{layer}.g_idx reorders input channels (act-order): not loaded")


def swap_in_int4(model: nn.Module, state: dict[str, torch.Tensor], group_size: int) -> None:
    """Turn each fused layer's PARTS in `state` into its module's tensors: the INT4 layer's
    (a meta-device Int4Linear put in the model, filled when the state loads), or a dense
    weight where the kernel cannot tile the layer's output width."""
    for name in [n for n in state if n.endswith(f".{PARTS[0]}")]:
        layer = name.removesuffix(f".{PARTS[0]}")
        codes, scales, zeros = (state.pop(f"{layer}.{part}") for part in PARTS)
        n, k = codes.shape
        if n % TILE_N:
            state[f"{layer}.weight"] = _dequantized(codes, scales, zeros, group_size)
            continue
        has_bias = f"{layer}.bias" in state
        with torch.device("meta"):
            set_submodule(model, layer, Int4Linear(k, n, group_size, has_bias, torch.float32))
        state[f"{layer}.qweight"] = pack_int4(codes)
        state[f"{layer}.scales_and_zeros"] = torch.stack([scales.t(), zeros.t()], dim=-1)


def _dequantized(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """[N, K] float weight: (code - 8) * scale + zero, each group's scale and zero."""
    scale = scales.repeat_interleave(group_size, dim=1)
    zero = zeros.repeat_interleave(group_size, dim=1)
    return (codes.float() - 8) * scale + zero
