"""A stored answer sent again: as a whole `chat.completion`, or streamed in the same chunk
format a generated answer streams in (role, content, tool calls, finish reason, usage,
`[DONE]`), so a client cannot tell a hit from a generation but by its headers and speed.

The answer gets this request's id and time, and usage counts this request's prompt
with the stored completion's tokens.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from starlette.responses import JSONResponse, Response

from serving.http.accepted import AcceptedRequest
from serving.http.schemas import responses as s


def replay_response(accepted: AcceptedRequest, headers: dict[str, str], usage: s.Usage) -> Response:
    """A hit's stored answer as this request's response with its `usage` (`replayed_usage`),
    streamed when it asked for a stream."""
    assert accepted.cache is not None and accepted.cache.entry is not None, "only hits replay"
    replayed = replayed_answer(accepted.cache.entry.answer, accepted.request_id, usage)
    if not accepted.body.stream:
        return JSONResponse(replayed, headers=headers)
    # The whole answer is known: one body, not a chunk per event, so it crosses the
    # proxy in one message and no worker thread iterates it.
    events = "".join(replayed_events(replayed, accepted.body.include_usage_chunk))
    return Response(events, media_type="text/event-stream", headers=headers)


def replayed_answer(answer: dict[str, Any], response_id: str, usage: s.Usage) -> dict:
    """The stored `chat.completion` as this request's response body."""
    stored = s.ChatCompletionResponse.model_validate(answer)
    replayed = stored.model_copy(
        update={"id": response_id, "created": int(time.time()), "usage": usage}
    )
    return replayed.model_dump(mode="json")


def replayed_usage(answer: dict[str, Any], num_prompt_tokens: int) -> s.Usage:
    """This request's prompt with the stored completion's tokens."""
    completion_tokens = answer["usage"]["completion_tokens"]
    return s.Usage(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=num_prompt_tokens + completion_tokens,
    )


def replayed_events(answer: dict[str, Any], include_usage: bool) -> Iterator[str]:
    """The answer (already `replayed_answer`) as SSE events, `[DONE]` last."""
    response = s.ChatCompletionResponse.model_validate(answer)
    for choice in response.choices:
        for delta, finish_reason in _deltas(choice):
            chunk_choice = s.ChatChunkChoice(
                index=choice.index, delta=delta, finish_reason=finish_reason
            )
            yield _event(_chunk(response, [chunk_choice]))
    if include_usage:
        yield _event(_chunk(response, [], response.usage))
    yield "data: [DONE]\n\n"


def _deltas(choice: s.ChatChoice) -> Iterator[tuple[s.ChatDelta, str | None]]:
    """A choice's chunks: the role, the content, each call whole, then the finish reason."""
    message = choice.message
    yield s.ChatDelta(role="assistant", content=""), None
    if message.content:
        yield s.ChatDelta(content=message.content), None
    for index, call in enumerate(message.tool_calls or []):
        function = s.FunctionCallDelta(name=call.function.name, arguments=call.function.arguments)
        call_delta = s.ToolCallDelta(index=index, id=call.id, type="function", function=function)
        yield s.ChatDelta(tool_calls=[call_delta]), None
    yield s.ChatDelta(), choice.finish_reason


def _chunk(
    response: s.ChatCompletionResponse,
    choices: list[s.ChatChunkChoice],
    usage: s.Usage | None = None,
) -> s.ChatCompletionChunk:
    return s.ChatCompletionChunk(
        id=response.id, created=response.created, model=response.model, choices=choices, usage=usage
    )


def _event(chunk: s.ChatCompletionChunk) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"
