"""Activation-aware weight quantization (AWQ, Lin et al. 2023): the calibration search.

Round to nearest spends the same precision on every input channel, yet a few
channels carry most of the activation magnitude, and their weights' errors are
the ones that show in the output. For each layer, on activations recorded
from the project's calibration prompts, we search

1. an input-channel scale s = mean|x|^alpha (alpha on a grid): the weight is
   quantized as W * s and the input divided by s, which gives the busy
   channels finer steps;
2. then, per output channel and group, a shrink of the quantization range
   (clipping outliers trades their error for finer steps for the rest);
3. for INT4, once rounded, each group's scale and zero are refitted to its
   codes by least squares weighted by the mean squared input of each channel
   (engine/quant.py `int4_codes`).

Steps 1 and 2 minimise the layer's output error on the recorded inputs, and
alpha = 0 with no shrink is plain RTN, so they cannot do worse than RTN there;
step 3 lowers the same error's diagonal part.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import cast

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from engine.model.chat import chat_prompt_ids
from engine.quant.maths import AwqParams, fake_quantize, scheme_of

DEFAULT_CALIBRATION_PATH = Path(__file__).resolve().parents[2] / "data" / "quality_prompts.jsonl"
SCALE_GRID = 20
CLIP_GRID = torch.linspace(1.0, 0.55, 10).tolist()
MAX_TOKENS = 512
"""Calibration rows kept per layer: enough for a stable search, small enough to be quick."""


def search_model(
    model: nn.Module, plan: dict[str, int], calibration: Sequence[torch.Tensor]
) -> dict[str, AwqParams]:
    """AWQ parameters for every layer of `plan` (name -> group size, 0 for INT8)."""
    inputs = collect_linear_inputs(model, list(plan), calibration)
    found = {}
    for name, group_size in plan.items():
        linear = model.get_submodule(name)
        assert isinstance(linear, nn.Linear)
        found[name] = search_layer(linear.weight, inputs[name], scheme_of(group_size), group_size)
    return found


def search_layer(weight: torch.Tensor, x: torch.Tensor, scheme: str, group_size: int) -> AwqParams:
    """weight [N, K], recorded inputs x [T, K] -> the layer's AwqParams."""
    weight, x = weight.detach().float(), x.float()
    input_scale = search_input_scale(weight, x, scheme, group_size)
    scaled_x = x * input_scale
    clip = search_clip(weight / input_scale, scaled_x, scheme, group_size)
    return AwqParams(input_scale, clip, importance=scaled_x.pow(2).mean(dim=0))


@torch.no_grad()
def search_input_scale(
    weight: torch.Tensor, x: torch.Tensor, scheme: str, group_size: int
) -> torch.Tensor:
    """The 1 / s [K] whose quantized layer best reproduces x @ weight.T."""
    reference = x @ weight.t()  # [T, N]
    activation = x.abs().mean(dim=0).clamp(min=1e-5)  # [K]
    best_error, best_scale = float("inf"), torch.ones_like(activation)
    for alpha in torch.arange(SCALE_GRID) / SCALE_GRID:
        scale = activation.pow(alpha)
        scale = scale / (scale.max() * scale.min()).sqrt()
        # (x / s) @ Q(W * s).T == x @ (Q(W * s) / s).T
        effective = fake_quantize(weight * scale, scheme, group_size) / scale
        error = (x @ effective.t() - reference).pow(2).mean().item()
        if error < best_error:
            best_error, best_scale = error, scale
    return 1 / best_scale


@torch.no_grad()
def search_clip(
    weight: torch.Tensor, x: torch.Tensor, scheme: str, group_size: int
) -> torch.Tensor:
    """Per output channel and group, the range shrink [N, G] with the least output error.

    A group's contribution to the output error is d @ H @ d, with d its weight
    error and H = X_g.T @ X_g the Gram matrix of its inputs, so every
    (channel, group) picks its own shrink independently.
    """
    n, k = weight.shape
    size = k if scheme == "int8" else group_size
    x_groups = x.view(-1, k // size, size)  # [T, G, size]
    gram = torch.einsum("tgi,tgj->gij", x_groups, x_groups)  # [G, size, size]
    best_error = torch.full((n, k // size), float("inf"), device=weight.device)
    best_clip = torch.ones(n, k // size, device=weight.device)
    for ratio in CLIP_GRID:
        clip = torch.full_like(best_clip, ratio)
        diff = (weight - fake_quantize(weight, scheme, group_size, clip)).view(n, -1, size)
        error = (torch.einsum("ngi,gij->ngj", diff, gram) * diff).sum(dim=-1)  # [N, G]
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best_clip = torch.where(better, clip, best_clip)
    return best_clip


@torch.no_grad()
def collect_linear_inputs(
    model: nn.Module, names: Iterable[str], calibration: Sequence[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Inputs each named Linear sees on the calibration sequences (<= MAX_TOKENS rows each)."""
    seen: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    hooks = [
        model.get_submodule(name).register_forward_pre_hook(
            lambda _mod, args, name=name: seen[name].append(args[0].reshape(-1, args[0].shape[-1]))
        )
        for name in seen
    ]
    forward = cast(Callable[[torch.Tensor], torch.Tensor], model.compute_logits_dense)
    device = next(model.parameters()).device  # calibration ids are made on the CPU
    try:
        for token_ids in calibration:
            forward(token_ids.to(device))
    finally:
        for hook in hooks:
            hook.remove()
    generator = torch.Generator().manual_seed(0)
    return {name: _subsample(torch.cat(rows), generator) for name, rows in seen.items()}


def _subsample(rows: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    if rows.shape[0] <= MAX_TOKENS:
        return rows
    keep = torch.randperm(rows.shape[0], generator=generator)[:MAX_TOKENS]
    return rows[keep.to(rows.device)]


def calibration_token_ids(
    tokenizer: PreTrainedTokenizerBase, path: Path = DEFAULT_CALIBRATION_PATH, split: str = "calib"
) -> list[torch.Tensor]:
    """The project's calibration prompts (never the eval ones) with their reference answers,
    chat-templated and tokenized by `tokenizer`, so any model can be calibrated on them."""
    sequences = []
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        if row["split"] != split:
            continue
        prompt = chat_prompt_ids(tokenizer, row["prompt"])
        answer = tokenizer.encode(row["reference"], add_special_tokens=False)
        sequences.append(torch.tensor(prompt + answer))
    if not sequences:
        raise ValueError(f"no {split!r} prompts in {path}")
    return sequences
