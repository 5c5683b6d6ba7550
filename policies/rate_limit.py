"""Per-key rate limits in sequences and tokens per minute, as token buckets.

Time is passed in, never read, so the limiter is deterministic under test.
"""

from __future__ import annotations

from dataclasses import dataclass


class RequestTooLarge(ValueError):
    """A request needs more than a bucket can ever hold: no wait would let it in."""

    def __init__(self, unit: str, amount: float, capacity: float) -> None:
        super().__init__(f"needs {amount:g} {unit} but the limit is {capacity:g} {unit} per minute")
        self.unit = unit
        self.amount = amount
        self.capacity = capacity


@dataclass
class TokenBucket:
    """Holds up to `capacity` units and refills `capacity` of them per minute."""

    capacity: float
    level: float
    updated_s: float

    @classmethod
    def full(cls, per_minute: int, now_s: float) -> TokenBucket:
        """A bucket that starts full: a new key may use its whole minute at once."""
        return cls(capacity=float(per_minute), level=float(per_minute), updated_s=now_s)

    def refill(self, now_s: float) -> None:
        """Add what flowed in since the last refill, up to capacity."""
        rate_per_s = self.capacity / 60
        self.level = min(self.capacity, self.level + (now_s - self.updated_s) * rate_per_s)
        self.updated_s = now_s

    def wait_s(self, amount: float) -> float:
        """Seconds until `amount` is available (0 when it is now); call after refill.

        Only defined for amounts the bucket can hold (see `RateLimiter.acquire`).
        """
        return max(0.0, (amount - self.level) / (self.capacity / 60))

    def take(self, amount: float) -> None:
        """Remove `amount`; the caller checked it is there."""
        self.level -= amount


class RateLimiter:
    """Sequences-per-minute and tokens-per-minute buckets for each key."""

    def __init__(self) -> None:
        self._buckets: dict[tuple[str, str], TokenBucket] = {}

    def acquire(
        self,
        key: str,
        num_sequences: int,
        num_tokens: int,
        now_s: float,
        sequences_per_minute: int | None,
        tokens_per_minute: int | None,
    ) -> float | None:
        """Charge a request of `num_sequences` and `num_tokens` to `key`; None if allowed,
        else the seconds to wait before retrying.

        Raises RequestTooLarge when the request exceeds a bucket's capacity:
        it could never be let in, and charging it only the capacity would be a
        free pass. Nothing is charged when the request is refused, so a client
        that backs off as told gets in.
        """
        limits = {
            "sequences": (sequences_per_minute, float(num_sequences)),
            "tokens": (tokens_per_minute, float(num_tokens)),
        }
        wanted = []
        for unit, (limit, amount) in limits.items():
            if limit is None:
                continue
            if amount > limit:
                raise RequestTooLarge(unit, amount, limit)
            wanted.append((self._bucket(key, unit, limit, now_s), amount))
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
