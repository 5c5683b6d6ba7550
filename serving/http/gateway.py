"""The gateway: who is calling (API keys), what they may ask for (tiers) and whether they
may call now (rate limits)."""

from __future__ import annotations

import hashlib
import hmac
import time

from policies.rate_limit import RateLimiter, RequestTooLarge
from serving.gateway_config import ApiKeyConfig, CallerPolicy, GatewayConfig
from serving.http.errors import ApiError, bad_request, forbidden, too_many_requests

RATE_LIMITED = "rate_limited"
"""The reason a key's rate limit gives for its 429s (request log, admission metric)."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


class Gateway:
    """Authenticates callers against the configured keys and charges their rate limits.

    Keys are read from their sources once, at construction (the ingress
    replica's start), and kept only as sha256 digests; a caller's key is
    compared with every digest in constant time, so neither timing nor a
    memory dump gives a key away.
    """

    def __init__(self, config: GatewayConfig) -> None:
        self._config = config
        self._keys: list[tuple[bytes, ApiKeyConfig]] = [
            (_digest(k.read_key()), k) for k in config.api_keys
        ]
        self._limiter = RateLimiter()

    def authenticate(self, authorization: str | None) -> CallerPolicy:
        """The caller's policy from `Authorization: Bearer <key>` (scheme in any case);
        401 when keys are required and the key is missing or unknown."""
        scheme, _, token = (authorization or "").strip().partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else ""
        found = self._match(token) if token else None
        if found is not None:
            return found
        if self._config.require_api_key:
            message = "Incorrect API key provided." if token else "Missing API key."
            raise ApiError(401, message, code="invalid_api_key")
        return self._config.anonymous

    def authorize_tier(self, caller: CallerPolicy, tier: str) -> None:
        """403 when the caller's key may not use `tier`."""
        if not caller.may_use(tier):
            allowed = sorted(caller.allowed_tiers or ())
            message = f"This API key may not use tier {tier!r}; allowed tiers: {allowed}."
            raise forbidden(message, param="tier")

    def charge(self, caller: CallerPolicy, num_sequences: int, num_tokens: int) -> None:
        """Count `num_sequences` and `num_tokens` against the caller's limits, or refuse:
        429 when it must wait, 400 when the request is larger than a limit allows at all."""
        try:
            retry_after_s = self._limiter.acquire(
                caller.name,
                num_sequences,
                num_tokens,
                time.monotonic(),
                caller.requests_per_minute,
                caller.tokens_per_minute,
            )
        except RequestTooLarge as error:
            message = (
                f"Request too large for key {caller.name!r}: it {error}. "
                "Reduce the prompt, max_tokens or n."
            )
            raise bad_request(message, code="request_too_large") from None
        if retry_after_s is not None:
            message = f"Rate limit reached for key {caller.name!r}."
            raise too_many_requests(message, retry_after_s, reason=RATE_LIMITED)

    def _match(self, token: str) -> ApiKeyConfig | None:
        digest = _digest(token)
        found = None
        for key_digest, key in self._keys:  # no early exit: every key costs the same
            if hmac.compare_digest(digest, key_digest):
                found = key
        return found
