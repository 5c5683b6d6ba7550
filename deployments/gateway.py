"""The gateway: who is calling (API keys) and whether they may call now (rate limits)."""

from __future__ import annotations

import time

from deployments.config import ApiKeyConfig, GatewayConfig
from deployments.errors import ApiError, too_many_requests
from policies.rate_limit import RateLimiter


class Gateway:
    def __init__(self, config: GatewayConfig) -> None:
        self._config = config
        self._keys = {k.key: k for k in config.api_keys}
        self._limiter = RateLimiter()

    def authenticate(self, authorization: str | None) -> ApiKeyConfig:
        """The caller's key from `Authorization: Bearer <key>`; 401 when keys are required."""
        token = (authorization or "").removeprefix("Bearer ").strip()
        key = self._keys.get(token)
        if key is not None:
            return key
        if self._config.require_api_key:
            message = "Incorrect API key provided." if token else "Missing API key."
            raise ApiError(401, message, code="invalid_api_key")
        return self._config.anonymous

    def charge(self, key: ApiKeyConfig, num_tokens: int) -> None:
        """Count one request of `num_tokens` against the key's limits, or raise a 429."""
        retry_after_s = self._limiter.acquire(
            key.name,
            num_tokens,
            time.monotonic(),
            key.requests_per_minute,
            key.tokens_per_minute,
        )
        if retry_after_s is not None:
            raise too_many_requests(f"Rate limit reached for key {key.name!r}.", retry_after_s)
