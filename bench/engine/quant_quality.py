"""How much a quantized model departs from the unquantized one, on fixed prompts.

For every eval prompt of data/quality_prompts.jsonl, both models score the
same text (prompt + the default model's reference continuation) with one
dense forward each. Over the continuation positions we report the mean
KL(unquantized || quantized) of the next-token distributions, the share of
positions where both pick the same top-1 token, and each model's perplexity
of the reference continuation.

The default model's weights were de-quantized from a Q4_1 GGUF (groups of
32), so re-quantizing to INT4 with group 32 can land on the original grid and
look unrealistically good: group 64 is the headline.

    python -m bench.engine.quant_quality [--quick] [--schemes int8,int4_g64_awq]
    python -m bench.engine.quant_quality --make-data    # regenerate the reference continuations
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

import torch

from bench.report import emit
from engine.config import EngineConfig, QuantConfig
from engine.model.chat import chat_prompt_ids
from engine.model.loader import load_model, resolve_model_dir
from engine.quant.awq import DEFAULT_CALIBRATION_PATH, calibration_token_ids
from engine.quant.linear import switch_to_int8_activations
from engine.quant.prepare import quantize_model

SCHEMES: dict[str, QuantConfig] = {
    "int8": QuantConfig("int8", method="rtn"),
    "int8_awq": QuantConfig("int8", method="awq"),
    "int8_a8": QuantConfig("int8", activations="int8"),
    "int4_g32_rtn": QuantConfig("int4", 32, "rtn"),
    "int4_g32_awq": QuantConfig("int4", 32, "awq"),
    "int4_g64_rtn": QuantConfig("int4", 64, "rtn"),
    "int4_g64_awq": QuantConfig("int4", 64, "awq"),
    "int4_g64_awq_a8": QuantConfig("int4", 64, "awq", activations="int8"),
    "int4_g64_awq_a8_head": QuantConfig(
        "int4", 64, "awq", quantize_lm_head=True, activations="int8"
    ),
    "int4_g64_awq_a8_head8": QuantConfig(
        "int4", 64, "awq", quantize_lm_head=True, activations="int8", int8_layers=("lm_head",)
    ),
    "int4_g32_awq_a8": QuantConfig("int4", 32, "awq", activations="int8"),
    "int4_g64_awq_a8_int8down": QuantConfig(
        "int4", 64, "awq", activations="int8", int8_layers=("down_proj",)
    ),
    "int4_g64_awq_a8_int8gateup": QuantConfig(
        "int4", 64, "awq", activations="int8", int8_layers=("gate_up_proj",)
    ),
    "int4_g128_rtn": QuantConfig("int4", 128, "rtn"),
    "int4_g128_awq": QuantConfig("int4", 128, "awq"),
}
QUICK_SCHEMES = ("int8", "int4_g64_rtn", "int4_g64_awq", "int4_g64_awq_a8")
QUICK_PROMPTS = 16
REFERENCE_TOKENS = 40
NOTES = {
    "int4_g128_rtn": "layers with K=576 use group 64 (576 % 128 != 0)",
    "int4_g128_awq": "layers with K=576 use group 64 (576 % 128 != 0)",
    "int4_g32_rtn": "weights come from a Q4_1 (g32) GGUF: g32 looks unrealistically good",
    "int4_g32_awq": "weights come from a Q4_1 (g32) GGUF: g32 looks unrealistically good",
    "int4_g64_awq_a8": "W4A8: activations quantized to int8 per row and group of 64",
    "int8_a8": "W8A8: activations quantized to int8 per row and group of 64",
    "int4_g64_awq_a8_head8": "W4A8, the lm_head (a fifth of the weights) W8A8",
    "int4_g32_awq_a8": "W4A8 g32: the GGUF's own grid, unrealistically good (see above)",
    "int4_g64_awq_a8_int8down": "mixed: W4A8, the MLP down projections W8A8",
    "int4_g64_awq_a8_int8gateup": "mixed: W4A8, the MLP gate/up projections W8A8",
}


def read_rows(path: Path, split: str = "eval") -> list[dict]:
    """The prompt rows of one split (calib or eval)."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [row for row in rows if row["split"] == split]


@torch.no_grad()
def continuation_logprobs(model: torch.nn.Module, row: dict) -> torch.Tensor:
    """fp32 log-probabilities [R, vocab] at the positions that predict the reference tokens."""
    prompt, reference = row["prompt_ids"], row["reference_ids"]
    logits = model.compute_logits_dense(torch.tensor(prompt + reference))
    return torch.log_softmax(logits[len(prompt) - 1 : -1].float(), dim=-1)


def compare(
    base: list[torch.Tensor], quant: list[torch.Tensor], rows: list[dict]
) -> dict[str, float]:
    """Mean KL, top-1 agreement and both perplexities over all continuation positions."""
    kl_sum = agree = nll_base = nll_quant = 0.0
    positions = 0
    for p, q, row in zip(base, quant, rows, strict=True):
        targets = torch.tensor(row["reference_ids"])
        kl_sum += (p.exp() * (p - q)).sum().item()
        agree += (p.argmax(-1) == q.argmax(-1)).sum().item()
        nll_base -= p.gather(1, targets[:, None]).sum().item()
        nll_quant -= q.gather(1, targets[:, None]).sum().item()
        positions += len(targets)
    return {
        "kl": kl_sum / positions,
        "top1_agreement": agree / positions,
        "ppl": math.exp(nll_quant / positions),
        "ppl_base": math.exp(nll_base / positions),
    }


def evaluate(names: list[str], num_prompts: int | None, dtype: str) -> list[dict]:
    """Quantize a fresh copy of the model per scheme and compare it with the unquantized one."""
    base_model, tokenizer = load_model(EngineConfig(dtype=dtype))
    rows = read_rows(DEFAULT_CALIBRATION_PATH)[:num_prompts]
    base = [continuation_logprobs(base_model, row) for row in rows]
    calibration = calibration_token_ids(tokenizer)
    results = []
    for name in names:
        start = time.perf_counter()
        model = quantize_model(copy.deepcopy(base_model), SCHEMES[name], calibration)
        if SCHEMES[name].activations == "int8":
            switch_to_int8_activations(model)
        quantize_s = time.perf_counter() - start
        metrics = compare(base, [continuation_logprobs(model, row) for row in rows], rows)
        results.append({"scheme": name, "quantize_s": quantize_s, **metrics})
        print(f"{name}: {metrics} ({quantize_s:.1f} s to quantize)", file=sys.stderr)
        del model
    return results


def rounding_floor(num_prompts: int | None) -> dict[str, float]:
    """The unquantized model run in bf16 against itself in fp32: how far rounding alone
    moves top-1 on these positions, a floor under what any quantized scheme can show."""
    base_model, _ = load_model(EngineConfig(dtype="float32"))
    rows = read_rows(DEFAULT_CALIBRATION_PATH)[:num_prompts]
    base = [continuation_logprobs(base_model, row) for row in rows]
    rounded = base_model.to(torch.bfloat16)
    return compare(base, [continuation_logprobs(rounded, row) for row in rows], rows)


def report_rounding_floor(num_prompts: int | None, **extra: object) -> None:
    """`top1_agreement.unquantized_bf16_vs_fp32`: the floor beside the schemes' figures."""
    floor = rounding_floor(num_prompts)["top1_agreement"]
    note = "no quantization: the model in bf16 against itself in fp32"
    emit("quant", "top1_agreement.unquantized_bf16_vs_fp32", floor, "ratio", note=note, **extra)


def report(results: list[dict], num_prompts: int, dtype: str) -> None:
    """One JSON line per figure, named as ../shared/BENCHMARKS.md asks."""
    common = {"n_prompts": num_prompts, "dtype": dtype, "model": "default"}
    emit("quant", f"ppl.{dtype}", results[0]["ppl_base"], "ppl", **common)
    for result in results:
        name, note = result["scheme"], NOTES.get(result["scheme"])
        extra = {"note": note, **common} if note else common
        emit("quant", f"top1_agreement.{name}", result["top1_agreement"], "ratio", **extra)
        emit("quant", f"kl.{name}", result["kl"], "nats", **extra)
        emit("quant", f"ppl.{name}", result["ppl"], "ppl", **extra)


@torch.no_grad()
def make_references(path: Path, max_new_tokens: int = REFERENCE_TOKENS) -> None:
    """Fill prompt_ids / reference_ids / reference for every prompt: greedy fp32 continuations
    of the default model (transformers `generate`, independent of our engine)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = resolve_model_dir("default", EngineConfig().cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows:
        prompt_ids = chat_prompt_ids(tokenizer, row["prompt"])
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False
        )
        row["prompt_ids"], row["reference_ids"] = prompt_ids, out[0, len(prompt_ids) :].tolist()
        row["reference"] = tokenizer.decode(row["reference_ids"])
        print(f"{row['id']}: {row['reference'][:60]!r}", file=sys.stderr)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def main() -> None:
    """Compare each scheme with bf16 on the eval prompts; print JSON lines."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK_PROMPTS} prompts, {QUICK_SCHEMES}"
    )
    parser.add_argument("--schemes", help=f"comma-separated subset of {list(SCHEMES)}")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--make-data", action="store_true", help="regenerate reference continuations"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.make_data:
        make_references(DEFAULT_CALIBRATION_PATH)
        return
    names = (
        args.schemes.split(",") if args.schemes else list(QUICK_SCHEMES if args.quick else SCHEMES)
    )
    unknown = [name for name in names if name not in SCHEMES]
    if unknown:
        parser.error(f"unknown schemes {unknown}; choose from {list(SCHEMES)}")
    num_prompts = QUICK_PROMPTS if args.quick else None
    results = evaluate(names, num_prompts, args.dtype)
    num_rows = num_prompts or len(read_rows(DEFAULT_CALIBRATION_PATH))
    report(results, num_rows, args.dtype)
    report_rounding_floor(num_prompts, n_prompts=num_rows, model="default")


if __name__ == "__main__":
    main()
