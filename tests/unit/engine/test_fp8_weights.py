"""FP8 checkpoints (issue 30 part 3) in both hub layouts, written here from their
specification: the engine computes the weights they store, codes times scales, against
transformers on a dense folder of those very weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from engine.config import EngineConfig, QuantConfig, default_cache_dir
from engine.model.fp8_weights import Fp8Weights
from engine.model.loader import resolve_model_dir
from engine.quant.linear import Int4Linear
from engine.quant.prepare import prepare_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BLOCK = (32, 64)
LAYOUTS = {
    "tensor": {"quant_method": "compressed-tensors", "format": "float-quantized",
               "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float",
                                                         "strategy": "tensor"}}}},
    "channel": {"quant_method": "compressed-tensors", "format": "float-quantized",
                "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float",
                                                          "strategy": "channel"}}}},
    "block": {"quant_method": "fp8", "weight_block_size": list(BLOCK)},
}  # fmt: skip
"""compressed-tensors per tensor and per output channel; transformers' fine-grained FP8
with a scale per 32 x 64 block (the widths here are not all multiples of it)."""
E4M3_MAX = 448.0


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def folders(request, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The checkpoint in one FP8 layout and the dense folder of the weights it stores."""
    root = tmp_path_factory.mktemp(request.param)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=256,
        initializer_range=0.1, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    dense = AutoModelForCausalLM.from_config(config).state_dict()
    fp8, stored = {}, {}
    for name, weight in dense.items():
        if name.endswith(".weight") and name.split(".")[-2] in LINEARS:
            codes, scale, scale_name = _to_fp8(weight, request.param)
            fp8 |= {name: codes, name.removesuffix("weight") + scale_name: scale}
            fp8[name.removesuffix("weight") + "input_scale"] = torch.ones(1)  # dropped at load
            stored[name] = codes.float() * _broadcast(scale, weight.shape)
        else:
            fp8[name] = stored[name] = weight.contiguous()
    quantized = {**config.to_dict(), "quantization_config": LAYOUTS[request.param]}
    return {
        "dense": _write(root / "dense", config.to_dict(), stored),
        "fp8": _write(root / "fp8", quantized, fp8),
    }


def _to_fp8(weight: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor, str]:
    if layout == "block":
        n, k = weight.shape
        padded = torch.zeros(-(-n // BLOCK[0]) * BLOCK[0], -(-k // BLOCK[1]) * BLOCK[1])
        padded[:n, :k] = weight
        blocks = padded.view(padded.shape[0] // BLOCK[0], BLOCK[0], -1, BLOCK[1])
        scale = blocks.abs().amax(dim=(1, 3)) / E4M3_MAX
        codes = (weight / _broadcast(scale, weight.shape)).to(torch.float8_e4m3fn)
        return codes, scale, "weight_scale_inv"
    if layout == "tensor":
        scale = (weight.abs().amax() / E4M3_MAX).reshape(1)
    else:
        scale = weight.abs().amax(1, keepdim=True) / E4M3_MAX  # [N, 1]
    return (weight / _broadcast(scale, weight.shape)).to(torch.float8_e4m3fn), scale, "weight_scale"


def _broadcast(scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Each weight's scale, by the layouts' definitions."""
    n, k = shape
    if scale.dim() == 2 and scale.shape != (n, 1):
        rows = scale.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)
        return rows[:n, :k]
    return scale.reshape(-1, 1).expand(n, k)


def _write(folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file({name: t.contiguous() for name, t in tensors.items()}, folder / "model.safetensors")
    default_dir = resolve_model_dir("default", default_cache_dir())
    for name in TOKENIZER_FILES:
        shutil.copy(default_dir / name, folder / name)
    return folder


def test_logits_are_those_of_the_weights_stored(folders, tokenizer) -> None:
    hf_dense = AutoModelForCausalLM.from_pretrained(folders["dense"], dtype=torch.float32)
    model, _ = prepare_model(EngineConfig(model=str(folders["fp8"]), dtype="float32"))
    prompt = torch.tensor(tokenizer.encode("The capital of France is"))
    with torch.inference_mode():
        ours = model.compute_logits_dense(prompt)
        theirs = hf_dense.eval()(prompt[None]).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_an_fp8_checkpoint_quantizes_to_int4_for_the_offline_pool(folders, tmp_path) -> None:
    config = EngineConfig(
        model=str(folders["fp8"]), dtype="float32", cache_dir=tmp_path,
        quant=QuantConfig(scheme="int4", group_size=32),
    )  # fmt: skip
    model, _ = prepare_model(config)
    assert any(isinstance(module, Int4Linear) for module in model.modules())


def test_compressed_tensors_of_another_kind_are_refused_by_name() -> None:
    quant = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    with pytest.raises(ValueError, match="quantization_config.format 'pack-quantized'"):
        Fp8Weights.from_hf_config({"quantization_config": quant})
