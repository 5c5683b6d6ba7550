"""Per-key rate limits in requests and tokens per minute, as token buckets.

Time is passed in, never read, so the limiter is deterministic under test.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenBucket:
    """Holds up to `capacity` units and refills `capacity` of them per minute."""

    capacity: float
    level: float
    updated_s: float

    @classmethod
    def full(cls, per_minute: int, now_s: float) -> TokenBucket:
        return cls(capacity=float(per_minute), level=float(per_minute), updated_s=now_s)

    def refill(self, now_s: float) -> None:
        rate_per_s = self.capacity / 60
        self.level = min(self.capacity, self.level + (now_s - self.updated_s) * rate_per_s)
        self.updated_s = now_s

    def wait_s(self, amount: float) -> float:
        """Seconds until `amount` is available (0 when it is now); call after refill."""
        # A request larger than the bucket waits for a full bucket rather than forever.
        missing = min(amount, self.capacity) - self.level
        return max(0.0, missing / (self.capacity / 60))

    def take(self, amount: float) -> None:
        self.level -= min(amount, self.capacity)


class RateLimiter:
    """Requests-per-minute and tokens-per-minute buckets for each key."""

    def __init__(self) -> None:
        self._buckets: dict[tuple[str, str], TokenBucket] = {}

    def acquire(
        self,
        key: str,
        num_tokens: int,
        now_s: float,
        requests_per_minute: int | None,
        tokens_per_minute: int | None,
    ) -> float | None:
        """Charge one request of `num_tokens` to `key`; None if allowed, else Retry-After seconds.

        Nothing is charged when the request is refused, so a client that backs
        off as told gets in.
        """
        limits = {
            "requests": (requests_per_minute, 1.0),
            "tokens": (tokens_per_minute, float(num_tokens)),
        }
        wanted = [
            (self._bucket(key, unit, limit, now_s), amount)
            for unit, (limit, amount) in limits.items()
            if limit is not None
        ]
        wait_s = max((bucket.wait_s(amount) for bucket, amount in wanted), default=0.0)
        if wait_s > 0:
            return wait_s
        for bucket, amount in wanted:
            bucket.take(amount)
        return None

    def _bucket(self, key: str, unit: str, per_minute: int, now_s: float) -> TokenBucket:
        bucket = self._buckets.setdefault((key, unit), TokenBucket.full(per_minute, now_s))
        bucket.refill(now_s)
        return bucket
