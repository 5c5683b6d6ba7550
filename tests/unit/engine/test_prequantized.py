"""AWQ and GPTQ INT4 checkpoints (issue 30 part 3), written here from the layouts'
specification (not by their libraries), loaded into the engine's INT4 layers as stored.

The reference is transformers on a dense folder holding the very weights the packed
codes mean, (q - z) * s: the engine must compute that model, not re-quantize it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_engine_parity import assert_same_greedy_tokens, hf_greedy
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig, QuantConfig, default_cache_dir
from engine.engine import LLMEngine
from engine.model.loader import resolve_model_dir
from engine.quant.linear import Int4Linear
from engine.quant.prepare import prepare_model
from engine.quant.prequantized import HubInt4
from testing.engine_helpers import greedy, run_requests
from testing.hub_checkpoints import INT4_CONFIGS, random_llama, write_folder, write_int4

SHAPES = {
    "wide": dict(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                 num_key_value_heads=2, group_size=64),
    "narrow": dict(hidden_size=96, intermediate_size=128, num_attention_heads=3,
                   num_key_value_heads=1, group_size=32),
}  # fmt: skip
"""`wide`: every projection's width tiles the INT4 kernel (64). `narrow`: q/k/v (160),
o and down (96) do not, and are computed dense from the same codes."""
PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4, 5, 6, 7, 8,"]
MAX_TOKENS = 24


@pytest.fixture(scope="module", params=sorted(SHAPES))
def shape(request) -> dict:
    return SHAPES[request.param]


@pytest.fixture(scope="module")
def folders(shape: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The checkpoint in each layout, and the dense folder of the weights they mean."""
    root = tmp_path_factory.mktemp("prequantized")
    group_size = shape["group_size"]
    dense, config = random_llama(**{k: v for k, v in shape.items() if k != "group_size"})
    tokenizer_dir = resolve_model_dir("default", default_cache_dir())
    folders = {}
    for method in INT4_CONFIGS:
        folders[method] = root / method
        meant = write_int4(dense, config, method, group_size, folders[method], tokenizer_dir)
    folders["dense"] = write_folder(root / "dense", config, meant, tokenizer_dir)
    return folders


@pytest.fixture(scope="module")
def hf_dense(folders):
    return AutoModelForCausalLM.from_pretrained(folders["dense"], dtype=torch.float32).eval()


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_logits_are_those_of_the_weights_the_codes_mean(folders, hf_dense, tokenizer, method):
    model, _ = prepare_model(EngineConfig(model=str(folders[method]), dtype="float32"))
    int4 = [name for name, module in model.named_modules() if isinstance(module, Int4Linear)]
    assert any(name.endswith("gate_up_proj") for name in int4)  # 256 or 512 wide: tiled
    prompt = torch.tensor(tokenizer.encode(PROMPTS[0]))
    with torch.inference_mode():
        ours = model.compute_logits_dense(prompt)
        theirs = hf_dense(prompt[None]).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_greedy_through_the_engine_matches_transformers(folders, hf_dense, tokenizer, method):
    engine = LLMEngine(EngineConfig(model=str(folders[method]), dtype="float32", max_num_seqs=4))
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    params = greedy(MAX_TOKENS, ignore_eos=True)
    done = run_requests(engine, {f"p{i}": (p, params) for i, p in enumerate(prompts)})
    for i, prompt in enumerate(prompts):
        theirs, logits = hf_greedy(hf_dense, prompt, MAX_TOKENS, min_new_tokens=MAX_TOKENS)
        assert_same_greedy_tokens(done[f"p{i}"].token_ids, theirs, logits)


def test_a_sharded_checkpoint_loads_the_files_its_index_names(folders, tmp_path, tokenizer):
    """Two shards and their index; a stray file the index does not name is not read."""
    folder = shutil.copytree(folders["awq"], tmp_path / "sharded")
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for file, shard in shards.items():
        save_file({name: tensors[name] for name in shard}, folder / file)
    save_file({"stray": torch.zeros(1)}, folder / "consolidated.safetensors")
    weight_map = {name: file for file, shard in shards.items() for name in shard}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    prompt = torch.tensor(tokenizer.encode(PROMPTS[1]))
    logits = {}
    for name, path in (("sharded", folder), ("whole", folders["awq"])):
        model, _ = prepare_model(EngineConfig(model=str(path), dtype="float32"))
        with torch.inference_mode():
            logits[name] = model.compute_logits_dense(prompt)
    torch.testing.assert_close(logits["sharded"], logits["whole"], atol=0, rtol=0)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"bits": 8}, "bits"),
        ({"quant_method": "bitsandbytes"}, "quant_method"),
        ({"group_size": 256}, "group_size"),
        ({"version": "gemv"}, "version"),
        ({"quant_method": "gptq", "desc_act": True}, "desc_act"),
        ({"quant_method": "gptq", "checkpoint_format": "gptq_v2"}, "checkpoint_format"),
    ],
)
def test_settings_the_engine_does_not_load_are_refused_by_name(change: dict, field: str) -> None:
    quant = {**INT4_CONFIGS["awq"], "group_size": 64, **change}
    with pytest.raises(ValueError, match=f"quantization_config.{field} "):
        HubInt4.from_hf_config({"quantization_config": quant})


def test_act_order_groups_are_refused(folders, tmp_path) -> None:
    folder = shutil.copytree(folders["gptq"], tmp_path / "act-order")
    tensors = load_file(folder / "model.safetensors")
    name = next(n for n in tensors if n.endswith("q_proj.g_idx"))
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match="q_proj.g_idx reorders input channels"):
        prepare_model(EngineConfig(model=str(folder), dtype="float32"))


def test_quantizing_a_quantized_checkpoint_again_is_refused(folders) -> None:
    config = EngineConfig(model=str(folders["awq"]), quant=QuantConfig(scheme="int4"))
    with pytest.raises(ValueError, match=r"already quantized \(awq\): leave engine.quant unset"):
        prepare_model(config)
