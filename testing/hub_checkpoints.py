"""Checkpoints in the hub's quantized layouts, written from their specification.

What a team downloads (AutoAWQ's GEMM, GPTQ's, compressed-tensors' and transformers'
FP8) is written here by our own code, never by those libraries, so the engine's
readers (engine/quant/prequantized.py, engine/model/fp8_weights.py) are checked
against the layouts and not against themselves. Each writer also returns the dense
weights the checkpoint stands for, the reference to compare with.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig

QUANTIZED_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
AWQ_NIBBLE_CHANNELS = (0, 2, 4, 6, 1, 3, 5, 7)
"""AutoAWQ's GEMM packing: the output channel (of eight) in each nibble, lowest first."""
INT4_CONFIGS = {
    "awq": {"quant_method": "awq", "bits": 4, "version": "gemm", "zero_point": True},
    "gptq": {"quant_method": "gptq", "bits": 4, "desc_act": False, "sym": False,
             "checkpoint_format": "gptq"},
}  # fmt: skip
FP8_BLOCK = (32, 64)
FP8_CONFIGS = {
    "tensor": {"quant_method": "compressed-tensors", "format": "float-quantized",
               "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float",
                                                         "strategy": "tensor"}}}},
    "channel": {"quant_method": "compressed-tensors", "format": "float-quantized",
                "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float",
                                                          "strategy": "channel"}}}},
    "block": {"quant_method": "fp8", "weight_block_size": list(FP8_BLOCK)},
}  # fmt: skip
"""compressed-tensors per tensor and per output channel; transformers' fine-grained FP8
with a scale per FP8_BLOCK block."""
E4M3_MAX = 448.0

Tensors = dict[str, torch.Tensor]


def random_llama(**shape: int) -> tuple[Tensors, dict]:
    """A seeded 2-layer Llama of `shape` (hidden_size, intermediate_size, heads) on the
    default model's vocabulary, weights wide enough (0.1) that greedy picks rarely tie:
    its state and its config.json."""
    config = LlamaConfig(
        vocab_size=49152, num_hidden_layers=2, max_position_embeddings=256,
        initializer_range=0.1, tie_word_embeddings=False, **shape,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).state_dict(), config.to_dict()


def is_quantized_linear(name: str) -> bool:
    """A projection's weight, as hub quantizers choose them (never embeddings, norms or
    the head)."""
    return name.endswith(".weight") and name.split(".")[-2] in QUANTIZED_LINEARS


def write_int4(
    dense: Tensors, config: dict, method: str, group_size: int, folder: Path, tokenizer_dir: Path
) -> Tensors:
    """`dense`'s projections quantized to 4 bits and written in `method`'s layout (awq,
    gptq) with `config` and the tokenizer; returns the dense weights the codes mean."""
    pack = {"awq": _pack_awq, "gptq": _pack_gptq}[method]
    tensors, meant = {}, {}
    for name, weight in dense.items():
        if not is_quantized_linear(name):
            tensors[name] = meant[name] = weight.contiguous()
            continue
        codes, zeros, scales = _quantize_int4(weight, group_size)
        layer = name.removesuffix(".weight")
        tensors |= {
            f"{layer}.{key}": t for key, t in pack(codes, zeros, scales, group_size).items()
        }
        meant[name] = _int4_meaning(codes, zeros, scales, group_size)
    quant = {**INT4_CONFIGS[method], "group_size": group_size}
    write_folder(folder, {**config, "quantization_config": quant}, tensors, tokenizer_dir)
    return meant


def write_fp8(
    dense: Tensors, config: dict, layout: str, folder: Path, tokenizer_dir: Path
) -> Tensors:
    """`dense`'s projections in e4m3 with scales in `layout` (FP8_CONFIGS), written with
    `config` and the tokenizer; returns the dense weights the checkpoint stores."""
    tensors, meant = {}, {}
    for name, weight in dense.items():
        if not is_quantized_linear(name):
            tensors[name] = meant[name] = weight.contiguous()
            continue
        scale, scale_name = _fp8_scale(weight.float(), layout)
        codes = (weight.float() / _broadcast(scale, weight.shape)).to(torch.float8_e4m3fn)
        layer = name.removesuffix("weight")
        tensors |= {name: codes, layer + scale_name: scale, layer + "input_scale": torch.ones(1)}
        meant[name] = codes.float() * _broadcast(scale, weight.shape)
    quant = FP8_CONFIGS[layout]
    write_folder(folder, {**config, "quantization_config": quant}, tensors, tokenizer_dir)
    return meant


def write_folder(folder: Path, config: dict, tensors: Tensors, tokenizer_dir: Path) -> Path:
    """An HF model folder: config.json, one safetensors file, the tokenizer's files."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({name: t.contiguous() for name, t in tensors.items()}, folder / "model.safetensors")
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, folder / name)
    return folder


def _quantize_int4(weight: torch.Tensor, group_size: int):
    """Asymmetric 4-bit per group of inputs: codes [N, K], zero points and fp16 scales
    [G, N]. Zero points stay in 1..15: GPTQ stores them minus one in a nibble."""
    n, k = weight.shape
    groups = weight.float().view(n, k // group_size, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    scales = ((high - low) / 15).clamp(min=1e-4).half()
    zeros = (-low / scales.float()).round().clamp(1, 15)
    codes = (groups / scales.float()[..., None] + zeros[..., None]).round().clamp(0, 15)
    return codes.view(n, k).to(torch.int32), zeros.t().to(torch.int32), scales.t().contiguous()


def _int4_meaning(codes, zeros, scales, group_size: int) -> torch.Tensor:
    """(q - z) * s: the [N, K] weight both layouts stand for."""
    z = zeros.t().repeat_interleave(group_size, dim=1)
    s = scales.t().float().repeat_interleave(group_size, dim=1)
    return (codes - z) * s


def _words(nibbles: torch.Tensor) -> torch.Tensor:
    """[..., 8] values in 0..15 -> int32 [...], the first in the lowest nibble."""
    total = sum(nibbles[..., i].to(torch.int64) << (4 * i) for i in range(8))
    return ((total + 2**31) % 2**32 - 2**31).to(torch.int32).contiguous()


def _pack_gptq(codes, zeros, scales, group_size: int) -> Tensors:
    n, k = codes.shape
    return {
        "qweight": _words(codes.t().reshape(k // 8, 8, n).transpose(1, 2)),  # [K/8, N]
        "qzeros": _words((zeros - 1).reshape(-1, n // 8, 8)),  # [G, N/8]
        "scales": scales,
        "g_idx": torch.arange(k, dtype=torch.int32) // group_size,
    }


def _pack_awq(codes, zeros, scales, group_size: int) -> Tensors:
    order = list(AWQ_NIBBLE_CHANNELS)

    def interleaved(rows: torch.Tensor) -> torch.Tensor:  # [R, N] -> [R, N/8]
        return _words(rows.reshape(rows.shape[0], -1, 8)[..., order])

    return {"qweight": interleaved(codes.t()), "qzeros": interleaved(zeros), "scales": scales}


def _fp8_scale(weight: torch.Tensor, layout: str) -> tuple[torch.Tensor, str]:
    """The scale tensor of `layout` and its name's suffix."""
    scales: dict[str, Callable[[], torch.Tensor]] = {
        "tensor": lambda: weight.abs().amax().reshape(1),
        "channel": lambda: weight.abs().amax(1, keepdim=True),  # [N, 1]
        "block": lambda: _block_absmax(weight),
    }
    name = "weight_scale_inv" if layout == "block" else "weight_scale"
    return scales[layout]() / E4M3_MAX, name


def _block_absmax(weight: torch.Tensor) -> torch.Tensor:
    rows, columns = FP8_BLOCK
    n, k = weight.shape
    padded = torch.zeros(-(-n // rows) * rows, -(-k // columns) * columns)
    padded[:n, :k] = weight.abs()
    return padded.view(padded.shape[0] // rows, rows, -1, columns).amax(dim=(1, 3))


def _broadcast(scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Each weight's scale, by the layouts' definitions."""
    n, k = shape
    if scale.dim() == 2 and scale.shape != (n, 1):
        rows, columns = FP8_BLOCK
        return scale.repeat_interleave(rows, 0).repeat_interleave(columns, 1)[:n, :k]
    return scale.reshape(-1, 1).expand(n, k)
