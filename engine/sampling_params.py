"""Per-request sampling settings, validated before the engine allocates anything; and an
embedding request's pooling settings, which take the place of sampling (engine/pooling.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

MAX_TOP_LOGPROBS = 20
"""Most alternatives a request may ask log-probabilities of, per token (OpenAI's limit)."""
GREEDY_BELOW_TEMPERATURE = 1e-5
"""Temperatures below this are greedy (vLLM's rule): dividing logits by 1e-300 overflows."""
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
"""A seed is any 64-bit integer, signed or unsigned."""
MAX_PENALTY = 2.0
"""Presence and frequency penalties lie in [-2, 2] (OpenAI's range)."""
MAX_LOGIT_BIAS = 100.0
"""A logit bias lies in [-100, 100] (OpenAI's range: -100 bans a token, 100 forces it)."""


GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "ebnf"]


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint on the output, as text: hashable (compiled grammars are cached by it)
    and picklable (it crosses to the engine process with the rest of the params).
    engine/grammar.py compiles it."""

    kind: GrammarKind
    source: str = ""
    """The JSON schema (as JSON text), the regex, the EBNF grammar, or the choices as a
    JSON list of strings; empty for json_object."""
    strict: bool = True
    """json_schema only: no properties beyond the schema's (OpenAI's `strict`)."""


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of the sampler and of the stop checks.

    `temperature == 0` means greedy. `seed` makes sampling reproducible for
    this request alone, whatever else shares the batch.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 (or -1, OpenAI-compatible servers' spelling) disables top-k."""
    min_tokens: int = 0
    """EOS and stop tokens are suppressed until this many tokens were generated."""
    repetition_penalty: float = 1.0
    """CTRL's multiplicative penalty on every token of the prompt and output (1: off)."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token the output holds (OpenAI's rule)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time the output holds it (OpenAI's rule)."""
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    """(token id, bias) pairs added to the raw logits before anything else."""
    min_p: float = 0.0
    """Tokens less likely than min_p x the likeliest one are dropped (0: off)."""
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    include_stop_str_in_output: bool = False
    """Keep the stop string (or stop token's text) that ended the request in its text."""
    skip_special_tokens: bool = True
    """Leave special tokens (<|im_end|>, ...) out of the text."""
    ignore_eos: bool = False
    logprobs: int | None = None
    """Return each chosen token's log-probability and those of the `logprobs` likeliest
    tokens at its position (vLLM's convention: 0 is the chosen token alone; None: none)."""
    prompt_logprobs: int | None = None
    """The same for every prompt token after the first (an echo with logprobs): the prompt
    is then computed whole, never read from the prefix cache."""
    grammar: GrammarSpec | None = None
    """Constrained decoding: every token is drawn among those the grammar allows next,
    and the grammar's end (EOS allowed alone) ends the request."""

    def __post_init__(self) -> None:
        # Normalise list inputs from JSON so the dataclass stays hashable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", tuple(map(tuple, self.logit_bias)))
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field and its allowed range: no value that passes can
        poison a batch (NaN, infinities, zero or negative scales, ids past no vocabulary)."""
        self._check_sampling()
        self._check_penalties()
        self._check_lengths()
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {value}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be token ids (>= 0)")
        self._check_grammar()

    def _check_sampling(self) -> None:
        """Temperature, top-p, top-k, min-p and seed."""
        for name in ("temperature", "top_p", "min_p"):
            _check_finite(name, getattr(self, name))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be >= -1 (0 or -1 disable it), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be a 64-bit integer in [{SEED_MIN}, {SEED_MAX}]")

    def _check_penalties(self) -> None:
        """The repetition, presence and frequency penalties, and the logit biases."""
        _check_finite("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_finite(name, value)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value}")
        for token_id, bias in self.logit_bias:
            if token_id < 0:
                raise ValueError(f"logit_bias keys must be token ids (>= 0), got {token_id}")
            _check_finite("logit_bias", bias)
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                bounds = f"[-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]"
                raise ValueError(f"logit_bias values must be in {bounds}, got {bias}")

    def _check_grammar(self) -> None:
        """A grammar ends the output itself: EOS is the token its end allows, so EOS can be
        neither ignored nor banned (the row would have no token left to draw)."""
        if self.grammar is None:
            return
        if self.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with a grammar: its end is EOS")
        if self.min_tokens:
            raise ValueError("min_tokens cannot be combined with a grammar: it may end sooner")

    def _check_lengths(self) -> None:
        """max_tokens and min_tokens."""
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature 0, or so close to it that scaling would overflow."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def adjusts_logits(self) -> bool:
        """Whether a penalty or bias changes the logits before the choice: a greedy request
        without one takes the batched argmax."""
        return bool(
            self.repetition_penalty != 1.0
            or self.presence_penalty
            or self.frequency_penalty
            or self.logit_bias
        )

    @property
    def reads_output(self) -> bool:
        """Whether the presence or frequency penalty counts the output tokens so far."""
        return bool(self.presence_penalty or self.frequency_penalty)


def _check_finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")


@dataclass(frozen=True)
class PoolingParams:
    """How a prompt becomes one vector (picklable: it crosses to the engine process)."""

    pooling: Literal["mean", "last"] = "mean"
    """`mean` over every prompt position (/v1/embeddings), or the last position's state (the
    semantic cache's, over a prompt framed for it: serving/cache/question_embedding.py)."""
    normalize: bool = True
    """Scale to unit L2 norm, so a dot product is the cosine similarity."""


MEAN_POOLING = PoolingParams()
"""/v1/embeddings' pooling: the mean of the last layer's states, L2-normalized."""
