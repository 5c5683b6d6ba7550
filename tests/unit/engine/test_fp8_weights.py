"""FP8 checkpoints (issue 30 part 3) in both hub layouts, written here from their
specification: the engine computes the weights they store, codes times scales, against
transformers on a dense folder of those very weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig, QuantConfig, default_cache_dir
from engine.model.fp8_weights import Fp8Weights
from engine.model.loader import resolve_model_dir
from engine.quant.linear import Int4Linear
from engine.quant.prepare import prepare_model
from testing.hub_checkpoints import FP8_CONFIGS, random_llama, write_folder, write_fp8


@pytest.fixture(scope="module", params=sorted(FP8_CONFIGS))
def folders(request, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The checkpoint in one FP8 layout and the dense folder of the weights it stores (the
    widths here are not all multiples of a block)."""
    root = tmp_path_factory.mktemp(request.param)
    dense, config = random_llama(
        hidden_size=96, intermediate_size=160, num_attention_heads=3, num_key_value_heads=1
    )
    tokenizer_dir = resolve_model_dir("default", default_cache_dir())
    stored = write_fp8(dense, config, request.param, root / "fp8", tokenizer_dir)
    return {
        "dense": write_folder(root / "dense", config, stored, tokenizer_dir),
        "fp8": root / "fp8",
    }


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
