"""Per-request sampling settings, validated before the engine allocates anything."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_TOP_LOGPROBS = 20
"""Most alternatives a request may ask log-probabilities of, per token (OpenAI's limit)."""
GREEDY_BELOW_TEMPERATURE = 1e-5
"""Temperatures below this are greedy (vLLM's rule): dividing logits by 1e-300 overflows."""
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
"""A seed is any 64-bit integer, signed or unsigned."""


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
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    """Return each chosen token's log-probability and those of the `logprobs` likeliest
    tokens at its position (vLLM's convention: 0 is the chosen token alone; None: none)."""
    prompt_logprobs: int | None = None
    """The same for every prompt token after the first (an echo with logprobs): the prompt
    is then computed whole, never read from the prefix cache."""

    def __post_init__(self) -> None:
        # Normalise list inputs from JSON so the dataclass stays hashable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field and its allowed range: no value that passes can
        poison a batch (NaN, infinities, zero or negative scales)."""
        for name in ("temperature", "top_p", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be >= -1 (0 or -1 disable it), got {self.top_k}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be a 64-bit integer in [{SEED_MIN}, {SEED_MAX}]")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {value}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature 0, or so close to it that scaling would overflow."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE
