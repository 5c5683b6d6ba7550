"""A batch's input file checked before any line runs, and the records its output files hold.

Every line must be a JSON object `{"custom_id", "method": "POST", "url", "body"}`
whose url is the batch's endpoint and whose body that endpoint accepts (its output
grammar too: a `response_format` or tool schema the library refuses); custom
ids are unique. A file with any bad line fails validation as a whole (OpenAI's
behaviour), and the batch's `errors` name each bad line by its number, so a
nightly job learns every problem from one submission, not one per try.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from serving.batch.schemas import BatchError, BatchErrors
from serving.http.engine_inputs import output_grammar
from serving.http.errors import ApiError
from serving.http.openai_api import ENDPOINTS, parse_body
from serving.http.request_body import decode_json_object

MAX_REPORTED_ERRORS = 100
"""Line errors a failed batch lists; a file of a million bad lines still answers briefly."""


@dataclass(frozen=True)
class CheckedInput:
    """The lines to run, (custom_id, body as JSON text) in file order, or why none may."""

    lines: list[tuple[str, str]]
    errors: list[BatchError]


def check_input(content: bytes, endpoint: str, max_lines: int, max_depth: int) -> CheckedInput:
    """The input file's lines if every one is valid, else every problem found (up to
    MAX_REPORTED_ERRORS), each naming its line number (1-based, as editors count)."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        return _failed(BatchError(code="invalid_file", message="The file is not valid UTF-8."))
    rows = [(number, row) for number, row in enumerate(text.splitlines(), 1) if row.strip()]
    if not rows:
        return _failed(BatchError(code="empty_file", message="The input file has no lines."))
    if len(rows) > max_lines:
        message = f"The input file has {len(rows)} lines; a batch may have at most {max_lines}."
        return _failed(BatchError(code="too_many_lines", message=message))
    lines: list[tuple[str, str]] = []
    errors: list[BatchError] = []
    seen: set[str] = set()
    for number, row in rows:
        try:
            custom_id, body = _check_line(row, endpoint, max_depth, seen)
        except ApiError as error:
            errors.append(BatchError(line=number, **error.detail.model_dump(exclude={"type"})))
            continue
        seen.add(custom_id)
        lines.append((custom_id, json.dumps(body)))
    return CheckedInput(lines, errors[:MAX_REPORTED_ERRORS])


def _check_line(
    row: str, endpoint: str, max_depth: int, seen: set[str]
) -> tuple[str, dict[str, Any]]:
    """The line's custom_id and body; an ApiError naming the first thing wrong."""
    document = decode_json_object(row.encode("utf-8"), max_depth)
    custom_id = document.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise _line_error("custom_id must be a non-empty string", "custom_id")
    if custom_id in seen:
        raise _line_error(f"custom_id {custom_id!r} is used by an earlier line", "custom_id")
    if document.get("method") != "POST":
        raise _line_error('method must be "POST"', "method")
    if document.get("url") != endpoint:
        raise _line_error(f"url must be the batch's endpoint {endpoint!r}", "url")
    body = document.get("body")
    if not isinstance(body, dict):
        raise _line_error("body must be a JSON object", "body")
    output_grammar(parse_body(ENDPOINTS[endpoint].schema, body))  # a schema xgrammar refuses
    return custom_id, body


def _line_error(message: str, param: str) -> ApiError:
    return ApiError(400, message, code="invalid_request", param=param)


def _failed(error: BatchError) -> CheckedInput:
    return CheckedInput([], [error])


def output_record(
    record_id: str, custom_id: str, status_code: int, body: dict[str, Any]
) -> dict[str, Any]:
    """One line of an output or error file: the answer the endpoint gave, in OpenAI's shape."""
    return {
        "id": record_id,
        "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": body.get("id"), "body": body},
        "error": None,
    }


def errors_json(errors: list[BatchError]) -> str:
    """A failed batch's `errors` column: the list OpenAI's batch object carries."""
    return BatchErrors(data=errors).model_dump_json()
