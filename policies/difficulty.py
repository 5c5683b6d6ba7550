"""Which requests are easy enough for the small (distilled) model.

The ingress sends a request to the small model when its predicted probability
that the small model answers as well as the default model is at least a
threshold. The prediction has to be cheap enough for the ingress hot path, so
it is a logistic regression over a short vector of features read from the
prompt text (capped at MAX_CHARS) and the request's token counts, scored in
pure Python.

Labels come from running both models on a prompt set and scoring each answer
with a quality measure: 1 where the small model's answer is as good as the
default model's, 0 where it is not (soft labels in between are fine). The
threshold is calibrated so that a target share of traffic goes to the small
model.

The router is judged RouteLLM-style: the quality kept as a function of the
share of traffic moved, against routing the same share at random.

    quality kept(s) = sum of the chosen model's quality / sum of the default's
"""

from __future__ import annotations

import itertools
import json
import math
import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

FORMAT_VERSION = 1
"""Of a saved model; bump it when a feature's definition changes."""
MAX_CHARS = 4000
"""Only the prompt's first characters are read, so a huge prompt costs bounded time."""
MAX_WORD_LENGTH = 20.0
"""Mean word length is capped: a URL or base64 blob is one very long 'word'."""
_MAX_COUNT = 1 << 30
"""Token counts are capped so that their logarithm stays bounded."""

FEATURE_NAMES: tuple[str, ...] = (
    "log_prompt_tokens",
    "log_max_tokens",
    "log_words",
    "digit_share",
    "arithmetic",
    "cue_factual",
    "cue_reasoning",
    "cue_generation",
    "cue_transform",
    "multiple_choice",
    "log_sentences",
    "log_question_marks",
    "type_token_ratio",
    "repeated_bigram_share",
    "mean_word_length",
)
"""The features, in the order of a model's weights. No constant: the model has its bias."""


def _terms(alternatives: str) -> frozenset[str]:
    return frozenset(alternatives.split("|"))


CUES: dict[str, frozenset[str]] = {
    "cue_factual": _terms(
        "who|whom|which|when|where|capital|name|define|what is|what are|what was|what were|how many"
    ),
    "cue_reasoning": _terms(
        "why|explain|explanation|prove|proof|compare|contrast|analyze|analyse|reason|reasoning"
        "|justify|derive|step by step"
    ),
    "cue_generation": _terms(
        "write|story|essay|poem|code|function|program|compose|generate|draft|script"
    ),
    "cue_transform": _terms(
        "summarize|summarise|summary|rewrite|paraphrase|translate|list|extract|repeat|copy"
        "|convert|format"
    ),
}
"""Words (or phrases, with a space) that hint at the kind of task. Words are looked up in
the prompt's set of words, phrases in its words joined by spaces: regular expressions over
a long prompt would cost most of the time budget."""
_ARITHMETIC_WORDS = _terms("plus|minus|times|divided|multiplied")
_CHOICE_WORDS = _terms("option|options|choice|choices")
_ARITHMETIC = re.compile(r"\d\s*[-+*/×÷^x]\s*\d")
_CHOICE_LABELS = tuple(f"{before}{letter})" for before in " \n(" for letter in "abcde")
"""`a)` or `(a)`: an answer option (looked for in the text with a space in front)."""
_PUNCTUATION_TO_SPACE = bytes.maketrans(string.punctuation.encode(), b" " * len(string.punctuation))


def prompt_features(text: str, num_prompt_tokens: int, max_tokens: int | None) -> dict[str, float]:
    """The features of one request, keyed and ordered as FEATURE_NAMES.

    Deterministic, finite and bounded for any input: counts enter as logarithms
    of capped values, shares lie in [0, 1], and only the first MAX_CHARS
    characters of `text` are read. Sentences are counted as `.`, `!` and `?`
    marks. `max_tokens` None (no limit given) counts as 0.
    """
    text = text[:MAX_CHARS]
    padded = " " + text.lower()
    words = _words(padded)
    vocabulary = set(words)
    digits = sum(map(text.count, string.digits))
    arithmetic = not _ARITHMETIC_WORDS.isdisjoint(vocabulary) or (
        digits > 1 and _ARITHMETIC.search(padded) is not None
    )
    choices = any(label in padded for label in _CHOICE_LABELS)
    joined = f" {' '.join(words)} "
    return {
        "log_prompt_tokens": _log_count(num_prompt_tokens),
        "log_max_tokens": _log_count(max_tokens or 0),
        "log_words": math.log1p(len(words)),
        "digit_share": digits / len(text) if text else 0.0,
        "arithmetic": float(arithmetic),
        **{name: _cued(cues, vocabulary, joined) for name, cues in CUES.items()},
        "multiple_choice": float(choices or not _CHOICE_WORDS.isdisjoint(vocabulary)),
        "log_sentences": math.log1p(sum(map(text.count, ".!?"))),
        "log_question_marks": math.log1p(text.count("?")),
        **_word_shape(words, vocabulary),
    }


def _words(text: str) -> list[str]:
    """`text` split at whitespace and ASCII punctuation. Done on UTF-8 bytes: str.translate
    is slow on non-ASCII text, and an ASCII byte never occurs inside a multi-byte character,
    so the result is the same (lone surrogates pass through)."""
    raw = text.encode("utf-8", "surrogatepass").translate(_PUNCTUATION_TO_SPACE)
    return raw.decode("utf-8", "surrogatepass").split()


def _log_count(n: int) -> float:
    return math.log1p(min(max(n, 0), _MAX_COUNT))


def _cued(cues: frozenset[str], vocabulary: set[str], joined: str) -> float:
    """Whether any cue occurs; `joined` is the words with a space on either side of each."""
    return float(any(f" {cue} " in joined if " " in cue else cue in vocabulary for cue in cues))


def _word_shape(words: list[str], vocabulary: set[str]) -> dict[str, float]:
    """How varied and how long the words are: repetitive, short-worded prompts (copy this,
    repeat that) tend to be easy. Without words: no repetition and no length."""
    if not words:
        return {"type_token_ratio": 1.0, "repeated_bigram_share": 0.0, "mean_word_length": 0.0}
    num_bigrams = len(words) - 1
    distinct = len(set(zip(words, words[1:], strict=False)))
    repeated = 1.0 - distinct / num_bigrams if num_bigrams else 0.0
    return {
        "type_token_ratio": len(vocabulary) / len(words),
        "repeated_bigram_share": repeated,
        "mean_word_length": min(len("".join(words)) / len(words), MAX_WORD_LENGTH),
    }


@dataclass(frozen=True)
class DifficultyModel:
    """A fitted router: the probability that the small model suffices, and the threshold
    above which a request goes to it.

    Features are standardised with the means and scales of the training rows, so the
    weights (and their L2 penalty) compare across features.
    """

    feature_names: tuple[str, ...]
    weights: tuple[float, ...]
    bias: float
    means: tuple[float, ...]
    scales: tuple[float, ...]
    threshold: float
    """Score at or above which a request goes to the small model: inf routes nothing,
    -inf everything."""
    target_share: float
    """The share of traffic the threshold was calibrated to send to the small model."""

    def __post_init__(self) -> None:
        if tuple(self.feature_names) != FEATURE_NAMES:
            raise ValueError(f"difficulty model features differ: {_difference(self.feature_names)}")
        n = len(FEATURE_NAMES)
        if not len(self.weights) == len(self.means) == len(self.scales) == n:
            raise ValueError(f"difficulty model needs {n} weights, means and scales each")
        if not all(map(math.isfinite, (*self.weights, *self.means, *self.scales, self.bias))):
            raise ValueError("difficulty model weights, means, scales and bias must be finite")
        if min(self.scales) <= 0:
            raise ValueError("difficulty model scales must be positive")
        if math.isnan(self.threshold):
            raise ValueError("difficulty model threshold is NaN")
        _check_share(self.target_share)

    def score(self, features: Mapping[str, float]) -> float:
        """Probability that the small model's answer is as good as the default's."""
        z = self.bias
        for name, w, mean, scale in zip(
            self.feature_names, self.weights, self.means, self.scales, strict=True
        ):
            z += w * (features[name] - mean) / scale
        return _sigmoid(z)

    def routes_to_small(self, features: Mapping[str, float]) -> bool:
        """Whether the request goes to the small model."""
        return self.score(features) >= self.threshold

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data; an infinite threshold is written as the string "inf" or "-inf"
        (strict JSON has no infinity)."""
        threshold = self.threshold if math.isfinite(self.threshold) else str(self.threshold)
        return {
            "version": FORMAT_VERSION,
            "feature_names": list(self.feature_names),
            "weights": list(self.weights),
            "bias": self.bias,
            "means": list(self.means),
            "scales": list(self.scales),
            "threshold": threshold,
            "target_share": self.target_share,
        }

    @classmethod
    def from_dict(cls, data: Any) -> DifficultyModel:
        """The model `to_dict` wrote. Raises ValueError for another version, other
        features (naming the difference) or malformed data."""
        if not isinstance(data, Mapping):
            raise ValueError("difficulty model must be a JSON object")
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(
                f"difficulty model version {data.get('version')!r}, expected {FORMAT_VERSION}"
            )
        try:
            fields: dict[str, Any] = {
                "feature_names": tuple(data["feature_names"]),
                "weights": tuple(map(float, data["weights"])),
                "bias": float(data["bias"]),
                "means": tuple(map(float, data["means"])),
                "scales": tuple(map(float, data["scales"])),
                "threshold": float(data["threshold"]),
                "target_share": float(data["target_share"]),
            }
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed difficulty model: {e!r}") from e
        return cls(**fields)

    def save(self, path: Path) -> None:
        """Write the model as JSON."""
        path.write_text(json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n")

    @classmethod
    def load(cls, path: Path) -> DifficultyModel:
        """Read a model `save` wrote; ValueError if the file is not one."""
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not JSON: {e}") from e
        return cls.from_dict(data)


def _difference(names: Sequence[str]) -> str:
    missing = [n for n in FEATURE_NAMES if n not in names]
    extra = [n for n in names if n not in FEATURE_NAMES]
    if missing or extra:
        return f"missing {missing}, unexpected {extra}"
    return f"same names in another order: {list(names)}, expected {list(FEATURE_NAMES)}"


def _sigmoid(z: float) -> float:
    """Logistic function without overflow for any finite z."""
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


def _check_share(share: float) -> None:
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share {share} must be in [0, 1]")


def fit_difficulty_model(
    rows: Sequence[Mapping[str, float]],
    labels: Sequence[float],
    target_share: float,
    l2: float = 1e-2,
    steps: int = 50,
) -> DifficultyModel:
    """Fit the router to feature rows and labels in [0, 1] (1: the small model sufficed),
    with its threshold calibrated on the same rows to send `target_share` of them to the
    small model (recalibrate on held-out rows with `dataclasses.replace` and
    `calibrate_threshold` for an honest share).

    L2-regularised logistic regression (the bias is not penalised) by Newton's
    method: deterministic, and a few thousand rows take milliseconds. Raises
    ValueError for fewer than 2 rows, labels all equal (nothing to learn), labels
    outside [0, 1], non-finite features, a missing feature, or a share outside [0, 1].
    """
    _check_share(target_share)
    if l2 <= 0:
        raise ValueError(f"l2 {l2} must be positive")
    x, y = _training_arrays(rows, labels)
    means = x.mean(axis=0)
    scales = x.std(axis=0)
    scales[scales == 0] = 1.0  # a constant feature: its weight stays 0 under the penalty
    theta = _newton((x - means) / scales, y, l2, steps)
    model = DifficultyModel(
        feature_names=FEATURE_NAMES,
        weights=tuple(theta[:-1].tolist()),
        bias=float(theta[-1]),
        means=tuple(means.tolist()),
        scales=tuple(scales.tolist()),
        threshold=math.inf,
        target_share=target_share,
    )
    threshold = calibrate_threshold([model.score(row) for row in rows], target_share)
    return replace(model, threshold=threshold)


def _training_arrays(
    rows: Sequence[Mapping[str, float]], labels: Sequence[float]
) -> tuple[np.ndarray, np.ndarray]:
    """Rows as a matrix in FEATURE_NAMES order and labels as a vector, both checked."""
    if len(rows) != len(labels):
        raise ValueError(f"{len(rows)} rows but {len(labels)} labels")
    if len(rows) < 2:
        raise ValueError("need at least 2 rows to fit a difficulty model")
    try:
        x = np.array([[row[name] for name in FEATURE_NAMES] for row in rows], dtype=np.float64)
    except KeyError as e:
        raise ValueError(f"a row lacks feature {e}") from e
    y = np.array(labels, dtype=np.float64)
    if not np.isfinite(x).all():
        raise ValueError("features must be finite")
    if not ((y >= 0) & (y <= 1)).all():
        raise ValueError("labels must be in [0, 1]")
    if y.min() == y.max():
        raise ValueError(f"all labels are {y[0]}: nothing to learn")
    return x, y


def _newton(x: np.ndarray, y: np.ndarray, l2: float, steps: int) -> np.ndarray:
    """Weights then bias minimising mean log loss + l2/2 * |weights|^2, by Newton's method
    with step halving (so the loss never rises)."""
    xb = np.hstack([x, np.ones((len(x), 1))])
    penalty = np.full(xb.shape[1], l2)
    penalty[-1] = 0.0
    theta = np.zeros(xb.shape[1])
    loss = _loss(xb, y, theta, penalty)
    for _ in range(steps):
        p = 0.5 * (1.0 + np.tanh(0.5 * (xb @ theta)))
        grad = xb.T @ (p - y) / len(y) + penalty * theta
        hess = (xb.T * (p * (1.0 - p))) @ xb / len(y) + np.diag(penalty + 1e-9)
        direction = np.linalg.solve(hess, grad)
        t, new_loss = 1.0, _loss(xb, y, theta - direction, penalty)
        while new_loss > loss and t > 1e-6:
            t /= 2
            new_loss = _loss(xb, y, theta - t * direction, penalty)
        if new_loss > loss:  # no descent left: at the optimum, to rounding
            break
        theta = theta - t * direction
        if loss - new_loss < 1e-12:
            break
        loss = new_loss
    return theta


def _loss(xb: np.ndarray, y: np.ndarray, theta: np.ndarray, penalty: np.ndarray) -> float:
    z = xb @ theta
    return float(np.mean(np.logaddexp(0.0, z) - y * z) + 0.5 * np.sum(penalty * theta**2))


def calibrate_threshold(scores: Sequence[float], target_share: float) -> float:
    """The threshold whose share of `scores` at or above it is closest to `target_share`.

    Tied scores route together, so only shares at the ends of tie groups are
    possible; between two equally close, the smaller share wins (it keeps more
    quality). Share 0 gives inf (routes nothing), share 1 gives -inf (routes
    everything, also scores lower than any seen here).
    """
    _check_share(target_share)
    if not scores:
        raise ValueError("no scores to calibrate on")
    if any(math.isnan(s) for s in scores):
        raise ValueError("scores must not be NaN")
    if target_share == 1.0:
        return -math.inf
    ordered = sorted(scores, reverse=True)
    want = target_share * len(ordered)
    best_count, best = 0, math.inf
    for i, score in enumerate(ordered):
        if i + 1 < len(ordered) and ordered[i + 1] == score:
            continue  # inside a tie group: no threshold stops here
        if abs(i + 1 - want) < abs(best_count - want):
            best_count, best = i + 1, score
    return best


def quality_curve(
    scores: Sequence[float],
    quality_small: Sequence[float],
    quality_default: Sequence[float],
    shares: Sequence[float],
) -> list[float]:
    """Quality kept when the top share `s` of prompts by score go to the small model,
    for each `s` in `shares`, relative to sending all to the default model.

    Tied scores are routed in random order, so they count at their mean; where
    `s * n` is fractional, the boundary prompt counts in proportion. Both make
    the curve an exact expectation, comparable with `random_curve`.
    """
    if len(scores) != len(quality_small):
        raise ValueError(f"{len(scores)} scores but {len(quality_small)} qualities")
    total = _default_total(quality_small, quality_default)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    gains: list[float] = []
    for _, group in itertools.groupby(order, key=lambda i: scores[i]):
        members = list(group)
        mean = sum(quality_small[i] - quality_default[i] for i in members) / len(members)
        gains.extend([mean] * len(members))
    prefix = list(itertools.accumulate(gains, initial=0.0))
    return [(total + _interpolate(prefix, _share(s) * len(gains))) / total for s in shares]


def _interpolate(prefix: list[float], x: float) -> float:
    k = min(int(x), len(prefix) - 1)
    if k == len(prefix) - 1:
        return prefix[k]
    return prefix[k] + (x - k) * (prefix[k + 1] - prefix[k])


def random_curve(
    quality_small: Sequence[float], quality_default: Sequence[float], shares: Sequence[float]
) -> list[float]:
    """Expected quality kept when a random share `s` of prompts goes to the small model:
    (s * sum(small) + (1 - s) * sum(default)) / sum(default)."""
    total = _default_total(quality_small, quality_default)
    small = float(sum(quality_small))
    return [(_share(s) * small + (1 - s) * total) / total for s in shares]


def _share(s: float) -> float:
    _check_share(s)
    return s


def _default_total(quality_small: Sequence[float], quality_default: Sequence[float]) -> float:
    """The denominator of quality kept, after checking the qualities line up."""
    if len(quality_small) != len(quality_default):
        raise ValueError(f"{len(quality_small)} small but {len(quality_default)} default qualities")
    total = float(sum(quality_default))
    if total <= 0:
        raise ValueError("the default model's quality sums to 0 or less: nothing to keep")
    return total


def auc_gain(
    shares: Sequence[float], router_curve: Sequence[float], random_curve: Sequence[float]
) -> float:
    """Area between the router's and random routing's quality curves over `shares`
    (trapezoid rule; positive: the router keeps more quality)."""
    if not len(shares) == len(router_curve) == len(random_curve):
        raise ValueError("shares and curves must have the same length")
    if any(b < a for a, b in itertools.pairwise(shares)):
        raise ValueError("shares must be increasing")
    gaps = [r - q for r, q in zip(router_curve, random_curve, strict=True)]
    return sum(
        (x1 - x0) * (g0 + g1) / 2
        for (x0, g0), (x1, g1) in itertools.pairwise(zip(shares, gaps, strict=True))
    )


def roc_auc(scores: Sequence[float], labels: Sequence[bool | int]) -> float:
    """Probability that a random positive outscores a random negative (ties count
    half): how well the scores rank prompts the small model handles first."""
    if len(scores) != len(labels):
        raise ValueError(f"{len(scores)} scores but {len(labels)} labels")
    if any(label not in (0, 1) for label in labels):
        raise ValueError("labels must be 0 or 1")
    positives = sum(labels)
    negatives = len(labels) - positives
    if positives == 0 or negatives == 0:
        raise ValueError("roc_auc needs both positive and negative labels")
    ordered = sorted(zip(scores, labels, strict=True), key=lambda pair: pair[0])
    rank_sum, start = 0.0, 0
    for _, group in itertools.groupby(ordered, key=lambda pair: pair[0]):
        members = [label for _, label in group]
        mean_rank = start + (len(members) + 1) / 2  # ranks start at 1; ties share the mean
        rank_sum += mean_rank * sum(members)
        start += len(members)
    return (rank_sum - positives * (positives + 1) / 2) / (positives * negatives)
