"""Fitting the difficulty router (policies/difficulty.py) offline, and judging it.

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
import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np

from policies.difficulty import FEATURE_NAMES, DifficultyModel, check_share


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
    check_share(target_share)
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
    check_share(target_share)
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
    check_share(s)
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
