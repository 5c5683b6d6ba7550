"""Checkpoint tensor names (transformers' layout) to the engine's module names.

The engine fuses q/k/v into one projection and gate/up into another (one
matmul each instead of three and two); checkpoints mostly store them apart,
Phi-3 already fused. Mixtral's experts go by their paper names (w1, w3, w2 in
`block_sparse_moe`), which become the gate/up/down of an MLP like any other.
Gemma's four norms a layer take the engine's names (its `post_attention_layernorm`
normalises the attention output, where Llama's is the norm before the MLP), and
its norm weights, stored as weight - 1, get their 1 back.
"""

from __future__ import annotations

import re

import torch

from engine.model.args import ModelArgs

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
"""Each fused projection and the checkpoint projections it concatenates, in order (rows)."""
_RENAMES = (
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),
    (re.compile(r"(\.experts\.\d+)\.w1\."), r"\1.gate_proj."),
    (re.compile(r"(\.experts\.\d+)\.w3\."), r"\1.up_proj."),
    (re.compile(r"(\.experts\.\d+)\.w2\."), r"\1.down_proj."),
)
_SANDWICH_RENAMES = (
    (re.compile(r"\.post_attention_layernorm\."), ".attn_out_norm."),
    (re.compile(r"\.pre_feedforward_layernorm\."), ".post_attention_layernorm."),
    (re.compile(r"\.post_feedforward_layernorm\."), ".mlp_out_norm."),
)


def engine_state_dict(
    hf_state: dict[str, torch.Tensor], args: ModelArgs
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the engine's names, projections fused, keeping
    only the first `args.num_layers` layers (a layer-truncated draft), no rotary buffers."""
    renames = _RENAMES + (_SANDWICH_RENAMES if args.sandwich_norms else ())
    state = {}
    for name, tensor in hf_state.items():
        name = _rename(name.removeprefix("model."), renames)
        if _wanted(name, args.num_layers):
            is_norm = name.endswith("norm.weight")
            state[name] = tensor + args.norm_offset if is_norm and args.norm_offset else tensor
    for target, parts in FUSED.items():
        _fuse(state, target, parts)
    return state


def _rename(name: str, renames: tuple[tuple[re.Pattern[str], str], ...]) -> str:
    for pattern, replacement in renames:
        name = pattern.sub(replacement, name)
    return name


def _wanted(name: str, num_layers: int) -> bool:
    if "rotary_emb" in name:
        return False
    return not name.startswith("layers.") or int(name.split(".")[1]) < num_layers


def _fuse(state: dict[str, torch.Tensor], target: str, parts: tuple[str, ...]) -> None:
    """Concatenate every module's `parts` (weights, and biases where all have one) into
    its `target`, wherever the first part appears."""
    first = f".{parts[0]}."
    for key in [k for k in state if first in k]:
        module, suffix = key.split(first)
        keys = [f"{module}.{part}.{suffix}" for part in parts]
        if all(k in state for k in keys):
            state[f"{module}.{target}.{suffix}"] = torch.cat([state.pop(k) for k in keys], dim=0)
