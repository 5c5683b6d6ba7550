"""An engine's token counters: prompt and generated totals, and recent rates of both.

Kept apart from the engine's step so `stats()` reads them and start-up calibration can
reset them without touching anything that schedules.
"""

from __future__ import annotations

import time
from collections import deque

RATE_WINDOW_S = 10.0
"""The recent rates are measured over this much recent time."""


class TokenCounters:
    """Totals since start (or the last reset) and a sliding window of each step's tokens."""

    def __init__(self) -> None:
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self._recent: deque[tuple[float, int, int]] = deque()
        """Each recent step's time, output tokens and prompt tokens computed."""

    def count_prompt(self, num_tokens: int) -> None:
        """A request's prompt was queued."""
        self.num_prompt_tokens += num_tokens

    def count_step(self, num_generated: int, num_prompt_computed: int) -> None:
        """A step produced `num_generated` output tokens (across the batch) and computed
        `num_prompt_computed` tokens of prompt chunks."""
        now = time.monotonic()
        self.num_generation_tokens += num_generated
        self._recent.append((now, num_generated, num_prompt_computed))
        self._forget_before(now - RATE_WINDOW_S)

    def generation_rate(self) -> float:
        """Output tokens per second over the recent window (0 before two steps)."""
        recent = self._recent
        span_s = (recent[-1][0] - recent[0][0]) if len(recent) > 1 else 0.0
        return sum(n for _, n, _ in recent) / span_s if span_s > 0 else 0.0

    def prompt_compute_rate(self) -> float:
        """Prompt tokens computed per second of the last RATE_WINDOW_S, idle time included:
        the steady flow of new prompts every decode shares its steps with."""
        self._forget_before(time.monotonic() - RATE_WINDOW_S)
        return sum(n for _, _, n in self._recent) / RATE_WINDOW_S

    def _forget_before(self, since_s: float) -> None:
        while self._recent and self._recent[0][0] < since_s:
            self._recent.popleft()

    def reset(self) -> None:
        """Forget everything counted so far."""
        self.num_prompt_tokens = self.num_generation_tokens = 0
        self._recent.clear()
