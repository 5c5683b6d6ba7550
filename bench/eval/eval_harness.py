"""An evaluation the way a nightly job runs one: lm-evaluation-harness against the server,
and the same scores computed directly with transformers, side by side.

  pip install -e '.[eval]'                      # lm-eval and its dependencies
  python -m bench.eval.eval_harness --local            # starts the app from configs/local.yaml
  python -m bench.eval.eval_harness --url http://HOST:8000 --api-key KEY

Two small tasks the project wrote (bench/eval/eval_tasks/): multiple choice scored by
log-likelihood (`acc`), and short answers generated greedily up to a newline and
checked (`exact_match`). lm-eval's `local-completions` model sends them to
/v1/completions as token ids: echo with logprobs for the likelihoods, `stop` for the
answers. Its API key is all it sends, so the key's default tier picks the pool;
with `--local` the run is made once per tier in --tiers, each through a key whose
default is that tier, each tier kept on its own pool (standard: the interactive
pool's fp32 weights; batch: the offline pool's INT4).

The transformers side scores the same documents with the fp32 model the pools
load: the continuation split as lm-eval splits it, the same answer normalisation.
Printed, one JSON line each: both scores per task and tier, and the largest
per-choice log-likelihood difference. On a pool with the model's own weights they
agree to float rounding; on the offline pool's INT4 weights the difference is
the quantization's.
"""

from __future__ import annotations

import argparse
import os
import re
import string
from pathlib import Path
from typing import Any

# lm-eval loads the tasks' local JSONL through `datasets`; nothing may reach for a hub.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from bench.report import emit, log  # noqa: E402
from engine.config import default_cache_dir  # noqa: E402
from engine.model.loader import resolve_model_dir  # noqa: E402
from serving.app_config import TierserveConfig, load_config  # noqa: E402
from serving.gateway_config import ApiKeyConfig, GatewayConfig  # noqa: E402
from testing.local_cluster import serving  # noqa: E402

BENCH = "eval"
TASKS_DIR = Path(__file__).resolve().parent / "eval_tasks"
SHOTS = (
    "Question: What is 8 minus 6?\nAnswer: 2\n\n"
    "Question: What is the capital of Portugal?\nAnswer: Lisbon\n\n"
)
"""Two worked examples before each question, so a small model answers in a word."""
PROMPT = SHOTS + "Question: {{question}}\nAnswer:"
MAX_ANSWER_TOKENS = 16
LOGLIKELIHOOD_TOLERANCE = 1e-3
"""Largest per-choice log-likelihood difference accepted on an unquantized pool."""


def task_configs() -> list[dict[str, Any]]:
    """The two tasks as lm-eval task configs (their data is committed JSONL)."""
    common = {"dataset_path": "json", "test_split": "test", "doc_to_text": PROMPT}
    return [
        {
            **common,
            "task": "tierserve_multiple_choice",
            "dataset_kwargs": {"data_files": {"test": str(TASKS_DIR / "multiple_choice.jsonl")}},
            "output_type": "multiple_choice",
            "doc_to_choice": "{{choices}}",
            "doc_to_target": "{{answer}}",
            "metric_list": [{"metric": "acc"}],
        },
        {
            **common,
            "task": "tierserve_short_answer",
            "dataset_kwargs": {"data_files": {"test": str(TASKS_DIR / "short_answer.jsonl")}},
            "output_type": "generate_until",
            "doc_to_target": "{{answer}}",
            "generation_kwargs": {"until": ["\n"], "max_gen_toks": MAX_ANSWER_TOKENS},
            "metric_list": [
                {"metric": "exact_match", "ignore_case": True, "ignore_punctuation": True,
                 "regexes_to_ignore": [r"\s"]},
            ],
        },
    ]  # fmt: skip


def run_lm_eval(base_url: str, api_key: str, model: str, tokenizer_dir: Path) -> dict[str, Any]:
    """lm-eval's own run against the server: its results with every sample logged."""
    import lm_eval

    os.environ["OPENAI_API_KEY"] = api_key  # local-completions sends it as the bearer key
    model_args = {
        "model": model,
        "base_url": f"{base_url}/v1/completions",
        "tokenizer": str(tokenizer_dir),
        "tokenizer_backend": "huggingface",
        "tokenized_requests": True,
        "num_concurrent": 4,
        "max_retries": 1,
    }
    results: dict[str, Any] = lm_eval.simple_evaluate(
        model="local-completions", model_args=model_args, tasks=task_configs(), log_samples=True
    )
    return results


class Reference:
    """The same tasks scored with transformers, lm-eval's way."""

    def __init__(self, model_dir: Path) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    @torch.inference_mode()
    def loglikelihood(self, context: str, continuation: str) -> float:
        """log P(continuation | context), split into tokens as lm-eval splits it: the whole
        text encoded once, the context's own tokens taken off the front."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole, prefix = self.encode(context + continuation), self.encode(context)
        logits = self.model(torch.tensor([whole])).logits[0].float()
        scores = torch.log_softmax(logits, dim=-1)
        positions = range(len(prefix), len(whole))
        return float(sum(scores[p - 1, whole[p]] for p in positions))

    @torch.inference_mode()
    def answer(self, prompt: str) -> str:
        """Greedy continuation up to the first newline (or MAX_ANSWER_TOKENS tokens)."""
        ids = torch.tensor([self.encode(prompt)])
        out = self.model.generate(
            ids, max_new_tokens=MAX_ANSWER_TOKENS, do_sample=False, pad_token_id=0
        )
        text = self.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        return text.split("\n", 1)[0]


def normalized(text: str) -> str:
    """The exact-match normalisation the task config asks lm-eval for."""
    text = re.sub(r"\s", "", text).lower()
    return text.translate(str.maketrans("", "", string.punctuation))


def compare(results: dict[str, Any], reference: Reference, tier: str) -> None:
    """Emit both sides' scores and how far apart the log-likelihoods are."""
    choice_samples = results["samples"]["tierserve_multiple_choice"]
    max_diff, correct = 0.0, 0
    for sample in choice_samples:
        doc = sample["doc"]
        context = prompt_of(doc)
        ours = [reference.loglikelihood(context, " " + choice) for choice in doc["choices"]]
        served = [float(resp[0][0]) for resp in sample["resps"]]
        max_diff = max(max_diff, *(abs(a - b) for a, b in zip(ours, served, strict=True)))
        correct += max(range(len(ours)), key=ours.__getitem__) == doc["answer"]
    answer_samples = results["samples"]["tierserve_short_answer"]
    matches = sum(
        normalized(reference.answer(prompt_of(s["doc"]))) == normalized(s["doc"]["answer"])
        for s in answer_samples
    )
    scores = results["results"]
    acc = scores["tierserve_multiple_choice"]["acc,none"]
    exact = scores["tierserve_short_answer"]["exact_match,none"]
    ref_acc, ref_exact = correct / len(choice_samples), matches / len(answer_samples)
    emit(BENCH, f"{tier}.multiple_choice.acc", acc, "share", transformers=ref_acc)
    emit(BENCH, f"{tier}.short_answer.exact_match", exact, "share", transformers=ref_exact)
    tolerance = LOGLIKELIHOOD_TOLERANCE
    emit(
        BENCH, f"{tier}.max_loglikelihood_diff", max_diff, "nats",
        tolerance=tolerance, within_tolerance=max_diff <= tolerance,
    )  # fmt: skip


def prompt_of(doc: dict[str, Any]) -> str:
    """The task's prompt for a document, as lm-eval renders PROMPT."""
    return PROMPT.replace("{{question}}", doc["question"])


def eval_config(config: TierserveConfig, tiers: list[str]) -> TierserveConfig:
    """The app with one API key per tier, each defaulting to its tier, and every tier kept
    on its own pool (no overflow): each run's scores come from one set of weights."""
    keys = tuple(ApiKeyConfig(name=f"eval-{t}", key=f"eval-{t}", default_tier=t) for t in tiers)
    gateway = GatewayConfig(require_api_key=True, api_keys=keys)
    pinned = tuple(
        t.model_copy(update={"overflow_pool": None, "on_slo_miss": "queue"}) for t in config.tiers
    )
    return config.model_copy(update={"gateway": gateway, "tiers": pinned})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--local", action="store_true", help="start the app on a private cluster")
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--config", type=Path, default=Path("configs/local.yaml"))
    parser.add_argument("--tiers", default="standard,batch", help="with --local")
    args = parser.parse_args()
    config = load_config(args.config)
    model_dir = resolve_model_dir("default", default_cache_dir())
    reference = Reference(model_dir)
    if not args.local:
        results = run_lm_eval(args.url, args.api_key, config.model_name, model_dir)
        compare(results, reference, "server")
        return
    tiers = args.tiers.split(",")
    with serving(eval_config(config, tiers)) as base_url:
        for tier in tiers:
            log(f"--- lm-eval on tier {tier}")
            results = run_lm_eval(base_url, f"eval-{tier}", config.model_name, model_dir)
            compare(results, reference, tier)


if __name__ == "__main__":
    main()
