"""`tierserve cache calibrate`: the semantic cache's similarity threshold, from the
project's paraphrase and near-miss pairs (serving/cache/calibration.py).

The pairs are embedded by the model the config's embedding pool serves, with that
pool's engine settings (dtype, quantization), the way the ingress embeds them: the
last user turn, normalized, framed as a question, its last position's state
(serving/cache/question_embedding.py). The curve (hit rate of paraphrases and false
hit rate of near misses by threshold) is printed for both splits; the threshold chosen
on the calibration split is written into the config file's `semantic_cache.threshold`.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path
from typing import Any

import numpy as np

from serving.cache.calibration import (
    DEFAULT_MAX_FALSE_HIT_RATE,
    PAIRS_FILE,
    CurvePoint,
    choose_threshold,
    curve,
    load_pairs,
    rates,
    separation_auc,
    similarities,
)
from serving.cache.question_embedding import POOLING, question_prompt

DEFAULT_CONFIG = Path("configs/local.yaml")
_THRESHOLD_LINE = re.compile(r"^(\s+threshold:\s*)([0-9.]+)(.*)$")


def add_commands(groups: Any) -> None:
    """Add the `cache` group and its `calibrate` command to the top-level parser."""
    group = groups.add_parser("cache", help="the semantic cache")
    commands = group.add_subparsers(dest="command", required=True)
    calibrate = commands.add_parser("calibrate", help="set the similarity threshold")
    calibrate.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    calibrate.add_argument("--pairs", type=Path, default=PAIRS_FILE)
    calibrate.add_argument(
        "--max-false-hit-rate", type=float, default=DEFAULT_MAX_FALSE_HIT_RATE,
        help="near misses the threshold may let through, on the calibration split",
    )  # fmt: skip
    calibrate.add_argument("--dry-run", action="store_true", help="print, write nothing")
    calibrate.set_defaults(run=run_calibrate)


def run_calibrate(args: argparse.Namespace) -> int:
    """Embed the pairs, print the curves, write the threshold."""
    from serving.app_config import load_config

    config = load_config(args.config)
    pairs = load_pairs(args.pairs)
    vectors = embed_texts(calibration_engine(config), [t for p in pairs for t in (p.a, p.b)])
    splits = {
        split: (
            similarities(pairs, vectors, "paraphrase", split),
            similarities(pairs, vectors, "near_miss", split),
        )
        for split in ("calibration", "held_out")
    }
    threshold = choose_threshold(*splits["calibration"], args.max_false_hit_rate)
    for split, (paraphrase, near_miss) in splits.items():
        auc = separation_auc(paraphrase, near_miss)
        print(
            f"{split}: {len(paraphrase)} paraphrases, {len(near_miss)} near misses, AUC {auc:.3f}"
        )
        _print_curve([*curve(paraphrase, near_miss), rates(paraphrase, near_miss, threshold)])
    held_out = rates(*splits["held_out"], threshold)
    print(
        f"threshold {threshold:.4f}: held-out hit rate {held_out.hit_rate:.3f}, "
        f"false hit rate {held_out.false_hit_rate:.3f}"
    )
    if not args.dry_run:
        write_threshold(args.config, threshold)
        print(f"wrote semantic_cache.threshold: {threshold:.4f} to {args.config}")
    return 0


def _print_curve(points: list[CurvePoint]) -> None:
    print("  threshold  hit_rate  false_hit_rate")
    for point in sorted(points, key=lambda p: p.threshold):
        print(f"  {point.threshold:9.4f}  {point.hit_rate:8.3f}  {point.false_hit_rate:14.3f}")


def calibration_engine(config: Any) -> Any:
    """An engine like the embedding pool's (its model, dtype and quantization), in this
    process: no speculation, no start-up calibration, a KV cache sized for the pairs."""
    from engine.engine import LLMEngine

    pool = config.pool(config.embedding_pool)
    engine_config = dataclasses.replace(
        pool.engine, spec_decode=None, calibrate_step_cost=False, separate_process=False,
        cpu_priority="inherit", num_kv_blocks=256, max_num_seqs=32, max_num_batched_tokens=512,
    )  # fmt: skip
    return LLMEngine(engine_config)


def embed_texts(
    engine: Any, texts: list[str], framed: bool = True, pooling: str = POOLING.pooling
) -> dict[str, np.ndarray]:
    """Each distinct text's embedding, keyed by the text as given: by default as the
    semantic cache makes it (normalized, framed as a question, the last position's state);
    unframed or mean-pooled for the comparison in bench_semantic_cache."""
    from engine.sampling_params import PoolingParams, SamplingParams
    from serving.cache.request_key import normalize

    distinct = sorted(set(texts))
    params = SamplingParams(max_tokens=1, temperature=0)
    for i, text in enumerate(distinct):
        prompt = question_prompt(normalize(text)) if framed else normalize(text)
        ids = engine.tokenizer.encode(prompt)
        engine.add_request(f"embed-{i}", ids, params, pooling=PoolingParams(pooling=pooling))
    vectors: dict[str, np.ndarray] = {}
    while engine.has_unfinished():
        for output in engine.step():
            text = distinct[int(output.request_id.removeprefix("embed-"))]
            vectors[text] = np.asarray(output.embedding, dtype=np.float32)
    return vectors


def write_threshold(path: Path, threshold: float) -> None:
    """Set `threshold:` inside the `semantic_cache:` block of the YAML file, keeping every
    other line (and comment) as it is; ValueError when the block has no such line."""
    lines = path.read_text().splitlines(keepends=True)
    block_indent: int | None = None
    for i, line in enumerate(lines):
        indent = len(line) - len(line.lstrip())
        if line.strip().startswith("semantic_cache:"):
            block_indent = indent
        elif block_indent is not None and line.strip() and indent <= block_indent:
            break
        elif block_indent is not None and (match := _THRESHOLD_LINE.match(line.rstrip("\n"))):
            lines[i] = f"{match.group(1)}{threshold:.4f}{match.group(3)}\n"
            path.write_text("".join(lines))
            return
    raise ValueError(f"{path} has no `threshold:` line in a `semantic_cache:` block; add one")
