"""An HTTP body to a JSON object, refusing what could hurt the ingress or the engine:
bodies over the size limit (413), invalid UTF-8, lone surrogates and nesting
past the depth limit (400).

Python's json module accepts a `\\ud800` escape and yields a string that
cannot be encoded again; such a string would fail deep inside the tokenizer or
the response encoder, so it is refused here, where the client can be told.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.requests import Request

from serving.http.errors import bad_request, payload_too_large


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The raw body, or a 413 as soon as it is known to be over `max_bytes`."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise payload_too_large(max_bytes)
    parts: list[bytes] = []
    size = 0
    async for part in request.stream():
        size += len(part)
        if size > max_bytes:
            raise payload_too_large(max_bytes)
        parts.append(part)
    return b"".join(parts)


async def read_json_object(request: Request, max_bytes: int, max_depth: int) -> dict[str, Any]:
    """The body as a JSON object, within `max_bytes` (413) and `max_depth` (400). Decoding
    a large body takes CPU time: it runs off the event loop, so one big prompt does not
    stall every other stream."""
    raw = await read_body(request, max_bytes)
    return await asyncio.to_thread(decode_json_object, raw, max_depth)


def decode_json_object(raw: bytes, max_depth: int) -> dict[str, Any]:
    """The body as a JSON object; a 400 naming what is wrong otherwise.

    CPU-bound on large bodies: the ingress runs it off the event loop.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request("The request body is not valid UTF-8.") from None
    try:
        value = json.loads(text)
    except RecursionError:
        raise _too_deep(max_depth) from None
    except ValueError:  # JSONDecodeError, and integers past Python's digit limit
        raise bad_request("The request body is not valid JSON.") from None
    if not isinstance(value, dict):
        raise bad_request("The request body must be a JSON object.")
    _check_values(value, max_depth)
    return value


def _check_values(root: dict[str, Any], max_depth: int) -> None:
    """Walk the document (iteratively: depth is the attack) checking depth and strings."""
    stack: list[tuple[Any, int]] = [(root, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            if depth > max_depth:
                raise _too_deep(max_depth)
            for key, item in value.items():
                _check_text(key)
                stack.append((item, depth + 1))
        elif isinstance(value, list):
            if depth > max_depth:
                raise _too_deep(max_depth)
            stack.extend((item, depth + 1) for item in value)
        elif isinstance(value, str):
            _check_text(value)


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        message = "The request body contains a lone UTF-16 surrogate (\\ud800-\\udfff)."
        raise bad_request(message) from None


def _too_deep(max_depth: int) -> Exception:
    return bad_request(f"The request body is nested deeper than {max_depth} levels.")
