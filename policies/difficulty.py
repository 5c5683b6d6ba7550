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

Fitting, calibration and the quality curves are offline work and live in
small_model/router_fit.py; this module is what the ingress loads and calls.
"""

from __future__ import annotations

import json
import math
import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

FORMAT_VERSION = 2
"""Of a saved model; bump it when a feature's definition changes. Version 2 added the
student the router was fitted to; version 1 files still load, fitted to no known student."""
READABLE_VERSIONS = (1, FORMAT_VERSION)
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


def student_recipe(settings_fingerprint: str, num_threads: int) -> str:
    """What makes a student's weights: its distillation settings and thread count. The same
    recipe publishes the same weights, bit for bit, on machines of one kind."""
    return f"{settings_fingerprint}-t{num_threads}"


@dataclass(frozen=True)
class StudentIdentity:
    """A student a router may be fitted to. Its name (`student-vN`) is for people only: every
    cache numbers its own students, so two caches' student-v1 may differ. Its weights digest
    names the very student; its recipe, the students one distillation command publishes."""

    name: str
    weights_sha256: str | None = None
    recipe: str | None = None

    @classmethod
    def from_card(cls, name: str, card: Mapping[str, Any]) -> StudentIdentity:
        """The identity a student's model card records (missing fields: None)."""
        reproducible = card.get("reproducible") or {}
        fingerprint = reproducible.get("settings_fingerprint")
        threads = reproducible.get("num_threads")
        recipe = student_recipe(fingerprint, threads) if fingerprint and threads else None
        return cls(name, reproducible.get("weights_sha256"), recipe)

    def __str__(self) -> str:
        """For log lines: the name and what identifies it."""
        if self.weights_sha256:
            return f"{self.name} (weights {self.weights_sha256[:12]})"
        return f"{self.name} (recipe {self.recipe})"


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
    student: StudentIdentity | None = None
    """The student whose answers labelled the training prompts (None: not recorded, as in a
    version 1 file): the router is only valid for it (see `fits`)."""

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
        check_share(self.target_share)

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

    def fits(self, served: StudentIdentity) -> bool:
        """Whether this router was fitted to the `served` student: the very weights where the
        router recorded them, else the same recipe (what a committed router records: it fits
        every student the reproducible default command publishes). A router that recorded
        neither (a version 1 file) fits no student: nothing says whose answers it learned."""
        fitted = self.student
        if fitted is None:
            return False
        if fitted.weights_sha256 is not None:
            return fitted.weights_sha256 == served.weights_sha256
        return fitted.recipe is not None and fitted.recipe == served.recipe

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
            "student": None if self.student is None else asdict(self.student),
        }

    @classmethod
    def from_dict(cls, data: Any) -> DifficultyModel:
        """The model `to_dict` wrote (or a version 1 file: no student). Raises ValueError for
        another version, other features (naming the difference) or malformed data."""
        if not isinstance(data, Mapping):
            raise ValueError("difficulty model must be a JSON object")
        if data.get("version") not in READABLE_VERSIONS:
            raise ValueError(
                f"difficulty model version {data.get('version')!r}, expected one of "
                f"{READABLE_VERSIONS}"
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
                "student": _student(data.get("student")),
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


def _student(data: Any) -> StudentIdentity | None:
    """The saved student identity, None where none was saved (TypeError for anything but
    an object of the identity's fields)."""
    return None if data is None else StudentIdentity(**data)


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


def check_share(share: float) -> None:
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share {share} must be in [0, 1]")
