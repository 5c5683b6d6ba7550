"""An engine's token counters: prompt and generated totals, and the recent generation rate.

Kept apart from the engine's step so `stats()` reads them and start-up calibration can
reset them without touching anything that schedules.
"""

from __future__ import annotations

import time
from collections import deque

RATE_WINDOW_S = 10.0
"""The generation rate is measured over this much recent time."""


class TokenCounters:
    """Totals since start (or the last reset) and a sliding window of generated tokens."""

    def __init__(self) -> None:
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self._recent: deque[tuple[float, int]] = deque()

    def count_prompt(self, num_tokens: int) -> None:
        """A request's prompt was queued."""
        self.num_prompt_tokens += num_tokens

    def count_generated(self, num_tokens: int) -> None:
        """A step produced `num_tokens` output tokens (across the batch)."""
        now = time.monotonic()
        self.num_generation_tokens += num_tokens
        self._recent.append((now, num_tokens))
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()

    def generation_rate(self) -> float:
        """Output tokens per second over the recent window (0 before two steps)."""
        recent = self._recent
        span_s = (recent[-1][0] - recent[0][0]) if len(recent) > 1 else 0.0
        return sum(n for _, n in recent) / span_s if span_s > 0 else 0.0

    def reset(self) -> None:
        """Forget everything counted so far."""
        self.num_prompt_tokens = self.num_generation_tokens = 0
        self._recent.clear()
