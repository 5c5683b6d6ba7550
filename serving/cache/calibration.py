"""The similarity threshold, from pairs of questions the project wrote
(data/semantic_cache/pairs.jsonl): paraphrases (the same question in other words: a
hit is right) and near misses (mostly the same words, another question: a hit is a
wrong answer). Each pair is in the `calibration` or the `held_out` split; the two share
no question, so the held-out figures measure a threshold that never saw them.

The threshold is the lowest similarity at which near misses of the calibration split
are hit at most `max_false_hit_rate` of the time: the most paraphrases are answered
from the cache that a wrong answer budget allows. Pure numpy: the vectors come from
the engine (cli/cache.py, bench/serving/bench_semantic_cache.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PAIRS_FILE = Path(__file__).resolve().parents[2] / "data" / "semantic_cache" / "pairs.jsonl"
SPLITS = ("calibration", "held_out")
DEFAULT_MAX_FALSE_HIT_RATE = 0.01


@dataclass(frozen=True)
class Pair:
    """Two questions and whether one's answer serves the other."""

    kind: str
    """`paraphrase` or `near_miss`."""
    split: str
    a: str
    b: str


@dataclass(frozen=True)
class CurvePoint:
    """Rates of a threshold on one split's pairs."""

    threshold: float
    hit_rate: float
    """Share of paraphrase pairs at or above the threshold (answered from the cache)."""
    false_hit_rate: float
    """Share of near-miss pairs at or above it (a wrong answer from the cache)."""


def load_pairs(path: Path = PAIRS_FILE) -> list[Pair]:
    """Every pair of the file, checked: a known kind and split each."""
    pairs = [Pair(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
    for pair in pairs:
        if pair.kind not in ("paraphrase", "near_miss") or pair.split not in SPLITS:
            raise ValueError(f"{path}: bad pair {pair}: kind paraphrase|near_miss, split {SPLITS}")
    return pairs


def similarities(
    pairs: list[Pair], vectors: dict[str, np.ndarray], kind: str, split: str
) -> np.ndarray:
    """Cosine similarity of each pair of `kind` in `split` (vectors are unit length)."""
    chosen = [p for p in pairs if p.kind == kind and p.split == split]
    return np.array([float(vectors[p.a] @ vectors[p.b]) for p in chosen])


def rates(paraphrase: np.ndarray, near_miss: np.ndarray, threshold: float) -> CurvePoint:
    """Hit and false-hit rates at `threshold`."""
    return CurvePoint(
        threshold,
        float(np.mean(paraphrase >= threshold)),
        float(np.mean(near_miss >= threshold)),
    )


def curve(paraphrase: np.ndarray, near_miss: np.ndarray, num_points: int = 21) -> list[CurvePoint]:
    """Rates at evenly spaced thresholds across the observed similarities."""
    low = float(min(paraphrase.min(), near_miss.min()))
    high = float(max(paraphrase.max(), near_miss.max()))
    return [rates(paraphrase, near_miss, t) for t in np.linspace(low, high, num_points)]


def choose_threshold(
    paraphrase: np.ndarray,
    near_miss: np.ndarray,
    max_false_hit_rate: float = DEFAULT_MAX_FALSE_HIT_RATE,
) -> float:
    """The lowest threshold whose false-hit rate stays within `max_false_hit_rate`:
    candidates are just above each observed similarity (and the lowest one itself)."""
    observed = np.sort(np.concatenate([paraphrase, near_miss]))
    candidates = [float(observed[0]), *(float(np.nextafter(s, 2.0)) for s in observed)]
    for threshold in candidates:
        if rates(paraphrase, near_miss, threshold).false_hit_rate <= max_false_hit_rate:
            return round(min(threshold, 1.0) + 5e-5, 4)  # rounded up: never below the bound
    return 1.0


def separation_auc(paraphrase: np.ndarray, near_miss: np.ndarray) -> float:
    """Probability that a random paraphrase pair is more similar than a random near-miss
    pair (ties count half): 1.0 separates perfectly, 0.5 not at all."""
    greater = (paraphrase[:, None] > near_miss[None, :]).mean()
    ties = (paraphrase[:, None] == near_miss[None, :]).mean()
    return float(greater + ties / 2)
