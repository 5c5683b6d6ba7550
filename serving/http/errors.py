"""Errors in OpenAI's format: every refusal is one of these, never a bare 500."""

from __future__ import annotations

import math

from starlette.responses import JSONResponse

from serving.http.schemas.responses import ErrorDetail, ErrorResponse


class ApiError(Exception):
    """An error the client caused or must react to, with OpenAI's status, type and code, and
    the reason the request log and the admission metric give for it (its code or type
    unless told: a 429 says which limit refused it)."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        retry_after_s: float | None = None,
        reason: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.detail = ErrorDetail(message=message, type=type_, param=param, code=code)
        self.retry_after_s = retry_after_s
        self.reason = reason or code or type_

    def response(self) -> JSONResponse:
        """The error as OpenAI's JSON body with its status (and Retry-After on a 429)."""
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(math.ceil(max(1.0, self.retry_after_s)))
        return JSONResponse(self.body(), status_code=self.status, headers=headers)

    def body(self) -> dict[str, object]:
        """OpenAI's error body, as JSON-ready fields."""
        return ErrorResponse(error=self.detail).model_dump(mode="json")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """400: the request itself is wrong; the message names the field."""
    return ApiError(400, message, param=param, code=code)


def too_many_requests(message: str, retry_after_s: float, reason: str) -> ApiError:
    """429 with Retry-After: the same request may succeed later. `reason` says what refused
    it: a key's rate limit or placement's shedding (policies/placement.py's reasons)."""
    return ApiError(
        429, message, type_="rate_limit_exceeded", retry_after_s=retry_after_s, reason=reason
    )


def forbidden(message: str, param: str | None = None) -> ApiError:
    """403: the key is valid but may not do this."""
    return ApiError(403, message, type_="permission_error", param=param)


def payload_too_large(max_bytes: int) -> ApiError:
    """413: the body is over the configured limit, refused before it is parsed."""
    message = f"The request body is larger than the limit of {max_bytes} bytes."
    return ApiError(413, message, code="request_too_large")


def deadline_exceeded(deadline_s: float) -> ApiError:
    """408: the request ran past its tier's deadline and was aborted."""
    message = f"The request did not finish within its deadline of {deadline_s:g} s and was aborted."
    return ApiError(408, message, type_="timeout_error", code="deadline_exceeded")


def replica_unavailable() -> ApiError:
    """503: the pool replica serving the request died; Serve replaces it, so a retry works."""
    message = "The replica serving this request failed; please retry."
    return ApiError(503, message, type_="server_error", code="replica_unavailable", retry_after_s=1)


def pool_unavailable(tier: str, retry_after_s: float) -> ApiError:
    """503: none of the tier's pools has a live replica now (a node was lost); Serve is
    placing a new one, so a retry after Retry-After works."""
    message = f"No pool serving tier {tier!r} is available now; please retry."
    return ApiError(
        503, message, type_="server_error", code="pool_unavailable", retry_after_s=retry_after_s
    )


def model_unavailable(model: str, why: str | None, retry_after_s: float) -> ApiError:
    """503: the named model has no serving replica now (the small model before it has been
    distilled, say why); the default model or `auto` still serve."""
    message = f"The model {model!r} is not available now ({why or 'no live replica'})."
    return ApiError(
        503, message, type_="server_error", code="model_unavailable", retry_after_s=retry_after_s
    )


def internal_error(request_id: str) -> ApiError:
    """500 for a fault of ours: no internals, only the id to find the logged traceback."""
    message = f"The server had an error while processing the request (request id {request_id})."
    return ApiError(500, message, type_="server_error", code="internal_error")


def context_length_exceeded(
    num_prompt_tokens: int, max_tokens: int, max_model_len: int
) -> ApiError:
    """OpenAI's wording, so clients that parse the numbers out of it keep working."""
    message = (
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the messages, "
        f"{max_tokens} in the completion). Please reduce the length of the messages or completion."
    )
    return bad_request(message, param="messages", code="context_length_exceeded")
