"""`POST /v1/chat/completions`: the conversation, tools and the chat-only fields."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from engine.sampling_params import MAX_TOP_LOGPROBS, GrammarSpec
from serving.http.request_fields import CHAT_FIELDS
from serving.http.schemas.sampling import SamplingFields, StrictModel
from serving.http.tool_calls import forced_calls_grammar


def _as_parts(value: Any) -> Any:
    """Message content as text parts: a plain string is one part, null is none."""
    if value is None:
        return []
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


class TextPart(StrictModel):
    """A content part; only text is served (the models here read no images)."""

    type: Literal["text"]
    text: str


class FunctionCallMessage(StrictModel):
    """The function an assistant's earlier call named, and its arguments as JSON text."""

    name: str
    arguments: str


class ToolCallMessage(StrictModel):
    """A call an assistant made earlier in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallMessage


class ChatMessage(StrictModel):
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


class FunctionTool(StrictModel):
    """A function the model may call: its name and its arguments' JSON schema."""

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    strict: bool | None = None
    """Arguments are constrained to the schema whenever a call is forced, strict or not."""


class Tool(StrictModel):
    """OpenAI's function tool."""

    type: Literal["function"]
    function: FunctionTool


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
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
