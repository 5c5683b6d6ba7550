"""What the ingress answers: completions whole and streamed, logprobs, tool calls, the
model list and OpenAI's error body."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


class Usage(BaseModel):
    """Token counts of a request (OpenAI's `usage`)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    """A token's text, log-probability and UTF-8 bytes (OpenAI's chat logprobs entry)."""

    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    """A chosen token with the likeliest alternatives at its position."""

    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """A chat choice's (or chunk's) `logprobs`: one entry per token."""

    content: list[ChatTokenLogprob]


class CompletionLogprobs(BaseModel):
    """A text completion choice's `logprobs`: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class FunctionCall(BaseModel):
    """The function a call names and its arguments (JSON text)."""

    name: str
    arguments: str


class ToolCall(BaseModel):
    """One call of a finished chat choice."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionCallDelta(BaseModel):
    """The name (once) or a piece of the arguments of a streamed call."""

    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """What one chunk adds to call `index`: its id, type and name first, then arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    """What one chat chunk adds to a choice."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    """One choice's part of a streamed chat chunk."""

    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class _Completion(BaseModel):
    """What every completion object, whole or streamed, starts with."""

    id: str
    created: int
    model: str


class ChatCompletionChunk(_Completion):
    """A streamed chat chunk (`chat.completion.chunk`)."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ChatResponseMessage(BaseModel):
    """The assistant message of a finished chat choice."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    """One finished chat choice."""

    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(_Completion):
    """A whole (non-streamed) chat completion."""

    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(BaseModel):
    """One text-completion choice, whole or as a streamed delta."""

    index: int
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(_Completion):
    """Both the whole response and, streamed, each chunk (OpenAI uses one shape for both)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class PoolModel(BaseModel):
    """One pool serving a model, as `GET /v1/models` describes it."""

    pool: str
    model: str
    """The pool's `engine.model`: `default`, `student`, a model folder or a GGUF file."""
    max_model_len: int | None
    """Its context length as its replicas report it (None before one has)."""
    seeded_reproducible: bool | None = None
    """Whether a seeded request gives the same text on it whatever shares its steps: every
    live replica's engine says so (EngineStats.seeded_reproducible; None before one has)."""


class ModelCard(BaseModel):
    """One entry of `GET /v1/models`."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tierserve"
    max_model_len: int | None = None
    """vLLM's field: the longest context a request naming the model can have, the largest
    of its pools' (None before any has reported)."""
    seeded_reproducible: bool | None = None
    """On every pool serving it (None before each has a replica that reported)."""
    pools: list[PoolModel] = []
    """The pools serving it (placement chooses among them by tier and load)."""


class ModelList(BaseModel):
    """`GET /v1/models`."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    """OpenAI's error object: message, type, param, code."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: `{"error": {...}}`."""

    error: ErrorDetail
