"""OpenAI-compatible request and response bodies (chat and text completions).

Requests carry, beside OpenAI's fields, the sampling extras that vLLM
clients and benchmark tools send (`top_k`, `min_p`, `min_tokens`,
`ignore_eos`, `repetition_penalty`, `stop_token_ids`,
`include_stop_str_in_output`, `skip_special_tokens`), the output grammars
(`response_format`, vLLM's `guided_*`: one at most) and tierserve's `tier`.
The schemas hold the fields tierserve honours and nothing else (extra fields
are forbidden): serving/http/request_fields.py classifies every field a client
may send and refuses, before these models see the body, whatever is not
honoured.

Fields are strict: numbers must be JSON numbers (not strings or booleans),
finite and in range, so nothing the sampler cannot use gets past the
ingress, and every refusal names its field. The bounds that are config (how
many prompts, stop strings) are checked by serving/http/limits.py; token ids
against the vocabulary by the endpoint that tokenizes (serving/http/openai_api.py).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from engine.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_PENALTY,
    MAX_TOP_LOGPROBS,
    SEED_MAX,
    SEED_MIN,
    GrammarKind,
    GrammarSpec,
)
from serving.http.request_fields import CHAT_FIELDS, COMPLETION_FIELDS, FieldRules
from serving.http.tool_calls import forced_calls_grammar


def _as_list(value: Any) -> Any:
    """OpenAI lets one string stand for a list of one; null stands for none."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else value


def _as_parts(value: Any) -> Any:
    """Message content as text parts: a plain string is one part, null is none."""
    if value is None:
        return []
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


def _as_prompts(value: Any) -> Any:
    """A completion prompt is text or token ids; one of either stands for a list of one,
    as in OpenAI's API."""
    if isinstance(value, list) and value and all(_is_int(v) for v in value):
        return [value]
    return _as_list(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


Finite = Annotated[float, Field(allow_inf_nan=False)]
Penalty = Annotated[Finite, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)]
TokenIds = list[Annotated[int, Field(ge=0)]]
StrList = Annotated[list[str], BeforeValidator(_as_list)]
LogitBias = dict[
    Annotated[str, Field(pattern=r"^[0-9]{1,9}$")],
    Annotated[Finite, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)],
]
"""OpenAI's shape: a token id (as a JSON object key, a string of digits) to a bias."""


class _Request(BaseModel):
    """Base of request bodies: strict types; a field the schema lacks is an error (the
    request_fields tables refuse it first, with a message saying why)."""

    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Request):
    """OpenAI's stream options: only `include_usage` is honoured."""

    include_usage: bool = False


class JsonSchemaFormat(_Request):
    """`response_format.json_schema`: OpenAI's named schema for structured outputs."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None
    """No property beyond the schema's (OpenAI's default is false)."""


class ResponseFormat(_Request):
    """OpenAI's `response_format`: free text, any JSON object, or JSON of a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with, and only with, type json_schema")
        return self

    @property
    def grammar(self) -> GrammarSpec | None:
        """The output grammar it asks for (none for text)."""
        if self.json_schema is not None:
            schema = json.dumps(self.json_schema.schema_)
            return GrammarSpec("json_schema", schema, strict=bool(self.json_schema.strict))
        return GrammarSpec("json_object") if self.type == "json_object" else None


class SamplingFields(_Request):
    """Fields shared by chat and text completion requests."""

    field_rules: ClassVar[FieldRules]
    """Every field a body of this endpoint may carry, classified (request_fields)."""

    model: str
    n: int = Field(default=1, ge=1)
    """Choices per prompt; n x prompts is bounded by the config's max_sequences."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Finite = Field(default=1.0, ge=0)
    top_p: Finite = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=-1)
    """0 or -1 turn top-k off."""
    min_tokens: int = Field(default=0, ge=0)
    repetition_penalty: Finite = Field(default=1.0, gt=0)
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: LogitBias | None = None
    """Token ids are checked against the vocabulary where the prompt is tokenized."""
    min_p: Finite = Field(default=0.0, ge=0, le=1)
    ignore_eos: bool = False
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: StrList = Field(default_factory=list)
    """Stop strings; one string or null are accepted, as OpenAI does."""
    stop_token_ids: TokenIds | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    tier: str | None = None
    """tierserve's SLA tier; the `X-SLA-Tier` header wins over it."""
    user: str | None = None
    """OpenAI's id of the caller's end user: written to the request log."""
    max_tokens: int | None = Field(default=None, ge=1)
    """None means the rest of the context, as vLLM does."""
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    """vLLM's: a JSON schema, as an object or as JSON text."""
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = None
    """vLLM's: an EBNF grammar (xgrammar's dialect)."""

    @model_validator(mode="after")
    def _one_grammar(self) -> SamplingFields:
        asked = self.grammar_params()
        if len(asked) > 1:
            raise ValueError(f"only one of {', '.join(asked)} may constrain the output")
        return self

    def grammar_params(self) -> list[str]:
        """The fields that ask for an output grammar (at most one passes validation)."""
        asked = {
            "response_format": self.response_format is not None
            and self.response_format.type != "text",
            "guided_json": self.guided_json is not None,
            "guided_regex": self.guided_regex is not None,
            "guided_choice": self.guided_choice is not None,
            "guided_grammar": self.guided_grammar is not None,
        }
        return [param for param, given in asked.items() if given]

    def grammar_of(self, param: str) -> GrammarSpec:
        """The grammar field `param` asks for (ValueError when it cannot be built)."""
        if param == "response_format":
            assert self.response_format is not None and self.response_format.grammar
            return self.response_format.grammar
        if param == "guided_json":
            schema = self.guided_json
            text = schema if isinstance(schema, str) else json.dumps(schema)
            return GrammarSpec("json_schema", text, strict=False)
        if param == "guided_choice":
            return GrammarSpec("choice", json.dumps(self.guided_choice))
        kind: GrammarKind = "regex" if param == "guided_regex" else "ebnf"
        return GrammarSpec(kind, getattr(self, param))

    @property
    def requested_max_tokens(self) -> int | None:
        """The output length the client asked for; None: the rest of the context."""
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per token to return log-probabilities of (0: the chosen token's
        alone; None: no logprobs), whatever the endpoint calls the fields."""
        return None

    @property
    def echoed_prompts(self) -> list[str] | list[TokenIds]:
        """Prompts to repeat before their completions (`echo`); none by default."""
        return []

    @property
    def routing_text(self) -> str:
        """What the difficulty router reads: the request's own words, without a template."""
        return ""

    @property
    def include_usage_chunk(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage


class TextPart(_Request):
    """A content part; only text is served (the models here read no images)."""

    type: Literal["text"]
    text: str


class FunctionCallMessage(_Request):
    """The function an assistant's earlier call named, and its arguments as JSON text."""

    name: str
    arguments: str


class ToolCallMessage(_Request):
    """A call an assistant made earlier in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallMessage


class ChatMessage(_Request):
    """One turn of the conversation."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[list[TextPart], BeforeValidator(_as_parts)] = Field(default_factory=list)
    tool_calls: list[ToolCallMessage] | None = None
    """An assistant's calls (rendered through the chat template)."""
    tool_call_id: str | None = None
    """Which call a `tool` turn answers."""

    def template_turn(self) -> dict[str, Any]:
        """The turn as chat templates read it (calls and call ids kept)."""
        turn: dict[str, Any] = {"role": self.role, "content": self.text}
        if self.tool_calls:
            turn["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            turn["tool_call_id"] = self.tool_call_id
        return turn

    @property
    def text(self) -> str:
        """The content as one string: text parts are joined, as the chat template expects."""
        return "".join(part.text for part in self.content)


class FunctionTool(_Request):
    """A function the model may call: its name and its arguments' JSON schema."""

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    strict: bool | None = None
    """Arguments are constrained to the schema whenever a call is forced, strict or not."""


class Tool(_Request):
    """OpenAI's function tool."""

    type: Literal["function"]
    function: FunctionTool


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    """`tool_choice` naming the one function to call."""

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    """`POST /v1/chat/completions`."""

    field_rules = CHAT_FIELDS
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """None: `auto` with tools, `none` without (OpenAI's defaults)."""
    parallel_tool_calls: bool = True
    max_completion_tokens: int | None = Field(default=None, ge=1)
    """OpenAI's newer name for max_tokens; wins when both are given."""
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    """Alternatives per token; OpenAI accepts it only with `logprobs: true`."""

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @model_validator(mode="after")
    def _choice_among_tools(self) -> ChatCompletionRequest:
        names = [tool.function.name for tool in self.tools or ()]
        if self.choice not in ("none", "auto") and not names:
            raise ValueError("tool_choice requires tools")
        if isinstance(self.choice, NamedToolChoice) and self.choice.function.name not in names:
            raise ValueError(f"tool_choice names {self.choice.function.name!r}, not in tools")
        return self

    @property
    def choice(self) -> str | NamedToolChoice:
        """`tool_choice`, its default filled in."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def offered_tools(self) -> list[dict[str, Any]] | None:
        """The tools the model is shown: none under `none`, so it is not invited to call
        (vLLM's exclude_tools_when_tool_choice_none)."""
        if not self.tools or self.choice == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def grammar_params(self) -> list[str]:
        """The sampling fields' grammar fields, and `tool_choice` when it forces a call."""
        forced = self.choice not in ("none", "auto")
        return [*super().grammar_params(), *["tool_choice"] * forced]

    def grammar_of(self, param: str) -> GrammarSpec:
        """A forced call's grammar (`required`: any tool; a named function: that one)."""
        if param != "tool_choice":
            return super().grammar_of(param)
        named = self.choice.function.name if isinstance(self.choice, NamedToolChoice) else None
        functions = {
            tool.function.name: tool.function.parameters
            for tool in self.tools or ()
            if named in (None, tool.function.name)
        }
        return forced_calls_grammar(functions, self.parallel_tool_calls)

    @property
    def requested_max_tokens(self) -> int | None:
        """`max_completion_tokens`, else `max_tokens`."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def routing_text(self) -> str:
        """The user turns: what is being asked."""
        return "\n".join(m.text for m in self.messages if m.role == "user")

    @property
    def num_logprobs(self) -> int | None:
        """`top_logprobs` alternatives when `logprobs` is true."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`: one prompt, or a list of them."""

    field_rules = COMPLETION_FIELDS
    prompt: Annotated[list[str] | list[TokenIds], BeforeValidator(_as_prompts)] = Field(
        min_length=1
    )
    """Each prompt, text or token ids (what evaluation harnesses send), is sampled n
    times; a single one is a list of one."""
    max_tokens: int | None = Field(default=16, ge=1)
    """OpenAI's default for text completions."""
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    """Alternatives per token whose log-probabilities come back (0: the chosen token's)."""
    echo: bool = False
    """Repeat the prompt before the completion, with its tokens' logprobs when asked: what
    evaluation harnesses score log-likelihoods with."""

    @property
    def num_logprobs(self) -> int | None:
        """The `logprobs` count."""
        return self.logprobs

    @property
    def echoed_prompts(self) -> list[str] | list[TokenIds]:
        """Every prompt, with `echo`."""
        return self.prompt if self.echo else []

    @property
    def routing_text(self) -> str:
        """The first prompt when it is text (token ids are routed by their count alone)."""
        first = self.prompt[0]
        return first if isinstance(first, str) else ""


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


class ModelCard(BaseModel):
    """One entry of `GET /v1/models`."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tierserve"


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
