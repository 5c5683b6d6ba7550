"""Errors in OpenAI's format: every refusal is one of these, never a bare 500."""

from __future__ import annotations

import math

from starlette.responses import JSONResponse

from deployments.schemas import ErrorDetail, ErrorResponse


class ApiError(Exception):
    """An error the client caused or must react to, with OpenAI's status, type and code."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.detail = ErrorDetail(message=message, type=type_, param=param, code=code)
        self.retry_after_s = retry_after_s

    def response(self) -> JSONResponse:
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(math.ceil(max(1.0, self.retry_after_s)))
        body = ErrorResponse(error=self.detail).model_dump(mode="json")
        return JSONResponse(body, status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def too_many_requests(message: str, retry_after_s: float) -> ApiError:
    return ApiError(429, message, type_="rate_limit_exceeded", retry_after_s=retry_after_s)


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
