"""A response as OpenAI's server-sent events: the endpoint's chunks, then `[DONE]`.

Once a stream has begun its status line is sent, so an error mid-stream (deadline, dead
replica, a fault of ours) goes out as an error event then `[DONE]`: never a hang or a cut
stream.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import TypeVar

from pydantic import BaseModel

from engine.outputs import RequestOutput
from serving.http.accepted import AcceptedRequest
from serving.http.errors import ApiError, internal_error
from serving.http.schemas.responses import ErrorResponse
from serving.http.streaming import usage

log = logging.getLogger(__name__)

T = TypeVar("T")


async def sse_stream(
    accepted: AcceptedRequest, events: AsyncIterator[tuple[int, RequestOutput]]
) -> AsyncIterator[str]:
    """OpenAI's chunk stream of `accepted`'s choices as their deltas arrive."""
    endpoint = accepted.endpoint
    try:
        for chunk in endpoint.opening(len(accepted.choices)):
            yield event(chunk)
        async for index, output in events:
            if output.new_text or output.finished or output.new_logprobs:
                yield event(endpoint.delta(index, output, accepted.choices[index]))
        if accepted.body.include_usage_chunk:
            yield event(endpoint.usage_chunk(usage(accepted.choices)))
    except ApiError as error:
        yield event(ErrorResponse(error=error.detail))
    except Exception:
        log.exception("stream %s failed", accepted.request_id)
        yield event(ErrorResponse(error=internal_error(accepted.request_id).detail))
    yield "data: [DONE]\n\n"


def event(chunk: BaseModel) -> str:
    """One SSE event carrying `chunk` as JSON."""
    return f"data: {chunk.model_dump_json()}\n\n"


async def prepend(first: T, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    """`first`, then the rest: a stream whose first item was awaited before it was sent."""
    yield first
    async for item in rest:
        yield item
