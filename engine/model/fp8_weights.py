"""FP8 checkpoints read: e4m3 codes and their scales, per layer.

Two layouts are on the hub: `compressed-tensors` ("float-quantized": each linear's
`weight` in float8_e4m3fn with a `weight_scale` per tensor, per output channel or
per block) and transformers' fine-grained FP8 (`quant_method: fp8`, a
`weight_scale_inv` per `weight_block_size` block, which despite its name
multiplies). Either way a weight is codes * scale, broadcast over what the scale
covers. This CPU has no FP8 matmul: engine/quant/fp8_linear.py computes the codes
with a kernel that decodes them in registers, reading a scale per output row and
group of inputs (`codes_and_row_scales`); to quantize further (INT4 for the
offline pool) or where that kernel does not run, the weights are expanded into
dense ones (`dequantized`). Activation and KV scales (`input_scale`, `k_scale`,
`v_scale`) serve FP8 matmuls and caches the engine does not run, and are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_METHODS = ("compressed-tensors", "fp8")
SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv")
UNUSED_SUFFIXES = (".input_scale", ".k_scale", ".v_scale")


@dataclass(frozen=True)
class Fp8Weights:
    """A checkpoint's FP8 layout, from its config.json's `quantization_config`."""

    block: tuple[int, int] | None
    """Rows and columns a block scale covers (None: scales per tensor or channel)."""

    @classmethod
    def from_hf_config(cls, hf_config: dict) -> Fp8Weights | None:
        """The FP8 layout; None for a checkpoint without FP8 weights; ValueError naming the
        format of a compressed-tensors checkpoint of another kind."""
        quant = hf_config.get("quantization_config") or {}
        method = quant.get("quant_method")
        if method not in FP8_METHODS:
            return None
        if method == "fp8":
            return cls(_block(quant.get("weight_block_size")))
        if quant.get("format") != "float-quantized":
            raise ValueError(
                f"quantization_config.format {quant.get('format')!r} is not loaded: "
                "compressed-tensors checkpoints load as 'float-quantized' (FP8)"
            )
        weights = [group.get("weights") or {} for group in quant["config_groups"].values()]
        return cls(
            _block(next((w["block_structure"] for w in weights if "block_structure" in w), None))
        )

    def dequantized(self, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The checkpoint with each FP8 weight expanded to float32 by its scale."""
        state = {n: t for n, t in hf_state.items() if not n.endswith(UNUSED_SUFFIXES)}
        for name in [n for n in state if n.endswith(SCALE_SUFFIXES)]:
            scale = state.pop(name).float()
            weight_name = name.rsplit(".", 1)[0] + ".weight"
            state[weight_name] = state[weight_name].float() * self._expanded(
                scale, state[weight_name].shape
            )
        return state

    def codes_and_row_scales(self, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The checkpoint with each FP8 weight kept as its codes (`<layer>.fp8_codes`, [N, K])
        and a scale per output row and group of inputs (`<layer>.fp8_scales`, [N, G]), the
        shape the FP8 kernel reads and fusing projections concatenates; a weight whose
        blocks do not tile its inputs evenly is expanded to float32 instead."""
        state = {n: t for n, t in hf_state.items() if not n.endswith(UNUSED_SUFFIXES)}
        for name in [n for n in state if n.endswith(SCALE_SUFFIXES)]:
            layer = name.rsplit(".", 1)[0]
            scale, codes = state.pop(name).float(), state.pop(f"{layer}.weight")
            row_scales = self._row_scales(scale, codes.shape)
            if row_scales is None:
                state[f"{layer}.weight"] = codes.float() * self._expanded(scale, codes.shape)
            else:
                state[f"{layer}.fp8_codes"], state[f"{layer}.fp8_scales"] = codes, row_scales
        return state

    def _row_scales(self, scale: torch.Tensor, shape: torch.Size) -> torch.Tensor | None:
        """[N, G] scales of equal groups of inputs (G = 1 per tensor or channel); None where
        the blocks leave a shorter last group (or there are no blocks to read them by)."""
        n, k = shape
        if scale.numel() == 1 or scale.shape in ((n,), (n, 1)):
            return scale.reshape(-1, 1).expand(n, 1).contiguous()
        if self.block is None:  # _expanded names the problem
            return None
        rows, columns = self.block
        return None if k % columns else scale.repeat_interleave(rows, 0)[:n].contiguous()

    def _expanded(self, scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The scale of each weight [N, K]: per tensor ([] or [1]), per output channel ([N]
        or [N, 1]) or per block."""
        n, k = shape
        if scale.numel() == 1 or scale.shape in ((n,), (n, 1)):
            return scale.reshape(-1, 1)
        if self.block is None:
            raise ValueError(
                f"a scale of shape {tuple(scale.shape)} for [{n}, {k}] needs a block size"
            )
        rows, columns = self.block
        return scale.repeat_interleave(rows, 0).repeat_interleave(columns, 1)[:n, :k]


def _block(size: list[int] | None) -> tuple[int, int] | None:
    return None if size is None else (int(size[0]), int(size[1]))
