"""The FP8 CPU kernel (engine/kernels/fp8_mm.c) in both builds (the CPU's widest vectors and
the 256-bit path) against its float64 torch reference: every code's decoding, scales per
channel and per group, batch and thread invariance; and the Fp8Linear layers a loaded FP8
checkpoint computes with."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig, default_cache_dir
from engine.kernels.fp8_mm import AVX2_FLAGS, NATIVE, Fp8Layout, fp8_mm_reference
from engine.model.loader import resolve_model_dir
from engine.quant.fp8_linear import Fp8Linear, computes_fp8
from engine.quant.prepare import prepare_model
from testing.hub_checkpoints import random_llama, write_fp8

pytestmark = pytest.mark.skipif(not NATIVE.available(), reason="no AVX2 / F16C / C compiler")

SHAPES = [(16, 64, 64), (960, 576, 576), (576, 1536, 128), (3072, 576, 64)]
"""(N, K, group): the smallest block, and the default model's projections per channel and
per block of inputs."""
E4M3_NAN = (0x7F, 0xFF)


@pytest.fixture(params=["native", "avx2"])
def layout(request) -> Fp8Layout:
    """Each build this CPU runs: its widest vectors, and the 256-bit path AVX2 CPUs get."""
    return NATIVE if request.param == "native" else Fp8Layout(AVX2_FLAGS)


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def dtype(request) -> torch.dtype:
    """The activations' dtype (the kernel computes in fp32 either way)."""
    return request.param


def _weight(n: int, k: int, group: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random e4m3 codes [N, K] over the whole range, and scales [N, K / group]."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(n, k, generator=generator) * 100
    codes = values.clamp(-448, 448).to(torch.float8_e4m3fn)
    return codes, torch.rand(n, k // group, generator=generator) * 1e-3 + 1e-5


def test_every_code_decodes_to_torchs_value(layout: Fp8Layout, dtype: torch.dtype) -> None:
    every = torch.tensor([c for c in range(256) if c not in E4M3_NAN], dtype=torch.uint8)
    rows = layout.rows_per_block()
    k = -(-every.numel() // 4) * 4  # whole groups of the kernel's partial sums
    codes = torch.zeros(rows, k, dtype=torch.uint8)
    codes[0, : every.numel()] = every
    codes = codes.view(torch.float8_e4m3fn)
    packed = layout.repack(codes, torch.ones(rows, 1))
    out = layout.matmul(torch.eye(k, dtype=dtype), *packed)  # row j reads input j alone
    assert torch.equal(out[:, 0].float(), codes[0].float().to(dtype).float())


@pytest.mark.parametrize("n,k,group", SHAPES)
def test_the_kernel_computes_its_reference(
    layout: Fp8Layout, dtype: torch.dtype, n: int, k: int, group: int
) -> None:
    codes, scales = _weight(n, k, group)
    packed = layout.repack(codes, scales)
    for m in (1, 2, 3, 4, 5, 6, 13):  # whole tiles (of 6 or 2 rows) and every remainder
        x = torch.randn(m, k).to(dtype)
        expected = fp8_mm_reference(x.double(), codes.float(), scales)
        # fp32 sums of k exact products: within a few ulps of the sum of their magnitudes,
        # plus the output's rounding to its dtype
        bound = 1e-6 * fp8_mm_reference(x.abs().double(), codes.float().abs(), scales)
        bound += expected.abs() * torch.finfo(dtype).eps
        assert ((layout.matmul(x, *packed).double() - expected).abs() <= bound).all()


def test_repack_round_trips(layout: Fp8Layout) -> None:
    codes, scales = _weight(64, 128, 32)
    back_codes, back_scales = layout.unpack(*layout.repack(codes, scales))
    assert torch.equal(back_codes.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(back_scales, scales)


def test_a_row_is_the_same_alone_in_any_batch_and_on_any_threads(
    layout: Fp8Layout, dtype: torch.dtype
) -> None:
    codes, scales = _weight(1536, 576, 576)
    packed = layout.repack(codes, scales)
    x = torch.randn(13, 576).to(dtype)
    batch = layout.matmul(x, *packed)
    for row in (0, 6, 12):
        assert torch.equal(layout.matmul(x[row : row + 1], *packed)[0], batch[row])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(layout.matmul(x, *packed), batch)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A per-channel FP8 checkpoint whose projections all fit the kernel's blocks, and the
    dense weights it stores."""
    dense, config = random_llama(
        hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2
    )
    folder = tmp_path_factory.mktemp("fp8") / "channel"
    tokenizer_dir = resolve_model_dir("default", default_cache_dir())
    return folder, write_fp8(dense, config, "channel", folder, tokenizer_dir)


def test_a_bf16_model_computes_its_projections_from_fp32_scales(fp8_checkpoint) -> None:
    folder, stored = fp8_checkpoint
    model, _ = prepare_model(EngineConfig(model=str(folder), dtype="bfloat16"))
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert len(layers) == 2 * 4  # qkv, o, gate_up and down in each of 2 layers
    assert all(layer.scales.dtype == torch.float32 for layer in layers)
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    qkv = [stored[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]
    assert torch.equal(model.layers[0].self_attn.qkv_proj.dequantized_weight(), torch.cat(qkv))


def test_tensor_parallel_ranks_load_fp8_expanded() -> None:
    # their shards are cut from dense projections (engine/parallel/shard.py)
    assert computes_fp8(EngineConfig())
    assert not computes_fp8(EngineConfig(tensor_parallel_size=2))
