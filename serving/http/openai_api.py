"""The OpenAI side of the ingress: request bodies parsed and their prompts tokenized,
engine progress to response bodies and stream chunks (the sampling fields become the
engine's in serving/http/engine_inputs.py).

Chat and text completions differ only here; the ingress treats both alike.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

from jinja2 import TemplateError
from pydantic import BaseModel, ValidationError

from engine.model.chat import chat_prompt_ids
from engine.outputs import RequestOutput, TokenLogprob
from serving.http.engine_inputs import check_sampling_token_ids
from serving.http.errors import bad_request
from serving.http.logprobs import chat_logprobs, completion_logprobs
from serving.http.request_fields import FieldRefused, served_fields
from serving.http.schemas.chat import ChatCompletionRequest
from serving.http.schemas.completion import CompletionRequest
from serving.http.schemas.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    CompletionChoice,
    CompletionResponse,
    FunctionCall,
    FunctionCallDelta,
    ToolCall,
    ToolCallDelta,
    Usage,
)
from serving.http.schemas.sampling import SamplingFields
from serving.http.streaming import SequenceProgress, usage
from serving.http.tool_calls import CallDelta, ToolCallStream, call_id, parse_tool_calls


def parse_body(schema: type[BaseModel], body: Any) -> Any:
    """Validate a JSON body against a schema with `field_rules` (a completion's, the
    embeddings'): a field the endpoint does not honour is refused (its table in
    serving/http/request_fields.py says why), then the schema checks the rest; either way
    the refusal is one OpenAI-style 400 naming the field."""
    try:
        rules = schema.field_rules  # type: ignore[attr-defined]
        return schema.model_validate(served_fields(rules, body))
    except FieldRefused as refusal:
        raise bad_request(str(refusal), refusal.param) from None
    except ValidationError as error:
        first = error.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        raise bad_request(f"{param}: {first['msg']}" if param else first["msg"], param) from None


class Echo(NamedTuple):
    """A prompt as the client sent it and as it was tokenized."""

    text: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class Endpoint(ABC):
    """One OpenAI endpoint: its body schema, its prompts, and the shapes it answers in.

    An instance renders one response: every chunk carries the same id and created time.
    """

    schema: ClassVar[type[SamplingFields]]
    response_id: str
    created: int
    model: str
    tokenizer: Any
    """Names the tokens of logprobs."""
    with_logprobs: bool = False
    echo: tuple[Echo, ...] = ()
    """The prompts to repeat before their completions, by prompt index (none: no echo)."""

    @classmethod
    def for_request(
        cls,
        body: Any,
        prompts: list[list[int]],
        response_id: str,
        created: int,
        model: str,
        tokenizer: Any,
    ) -> Endpoint:
        """The endpoint rendering `body`'s response (its `prompts` tokenized): with logprobs
        and echoed prompts when the body asks for them."""
        echo = tuple(
            Echo(sent if isinstance(sent, str) else tokenizer.decode(ids), tuple(ids))
            for sent, ids in zip(body.echoed_prompts, prompts, strict=False)
        )
        with_logprobs = body.num_logprobs is not None
        options = cls._options(body)
        return cls(response_id, created, model, tokenizer, with_logprobs, echo, **options)

    @staticmethod
    def _options(body: Any) -> dict[str, Any]:
        """The endpoint's own fields that the body decides."""
        return {}

    @classmethod
    def prompt_ids(cls, body: Any, tokenizer: Any) -> list[list[int]]:
        """Token ids of each prompt in the body (before `n` copies are made); first, the
        token ids the body's sampling fields name are checked against the vocabulary, which
        only the tokenizer knows (a 400 naming the field)."""
        check_sampling_token_ids(body, len(tokenizer))
        return cls._prompts(body, tokenizer)

    @staticmethod
    @abstractmethod
    def _prompts(body: Any, tokenizer: Any) -> list[list[int]]:
        """Token ids of each prompt in the body."""

    def opening(self, num_choices: int) -> list[BaseModel]:
        """Chunks sent before any token."""
        return []

    @abstractmethod
    def delta(self, index: int, output: RequestOutput, choice: SequenceProgress) -> BaseModel:
        """A stream chunk carrying the new text (and logprobs, and the finish reason at the
        end) of one choice; `choice` already holds the output."""

    @abstractmethod
    def usage_chunk(self, usage: Usage) -> BaseModel:
        """The stream's final chunk carrying usage, when the client asked for it."""

    @abstractmethod
    def response(self, choices: list[SequenceProgress]) -> BaseModel:
        """The whole response of a non-streamed request."""


@dataclass(frozen=True)
class ChatEndpoint(Endpoint):
    """`/v1/chat/completions`: a conversation through the chat template.

    Outputs are read for tool calls in the model's format (serving/http/tool_calls.py) only
    when the request offered tools and did not say `tool_choice: none`: otherwise a
    plain answer that happens to look like a call (a model quoting the format) is text.
    """

    schema = ChatCompletionRequest
    reads_tool_calls: bool = False
    """Whether outputs become `tool_calls` (tools were offered, not under `none`)."""
    tool_streams: dict[int, ToolCallStream] = field(default_factory=dict, repr=False)
    """Each streamed choice's text turned into content and call deltas, by index."""

    @staticmethod
    def _options(body: ChatCompletionRequest) -> dict[str, Any]:
        """Tool calls are read when the model was shown tools."""
        return {"reads_tool_calls": body.offered_tools is not None}

    @staticmethod
    def _prompts(body: ChatCompletionRequest, tokenizer: Any) -> list[list[int]]:
        """The conversation, and the tools offered, through the model's chat template; a
        template that refuses the conversation (its `raise_exception`) is the client's 400."""
        messages = [m.template_turn() for m in body.messages]
        try:
            return [chat_prompt_ids(tokenizer, messages, body.offered_tools)]
        except TemplateError as error:
            raise bad_request(f"messages: {error}", "messages") from None

    def opening(self, num_choices: int) -> list[BaseModel]:
        """OpenAI names the role in each choice's first delta."""
        return [
            self._chunk(ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content="")))
            for i in range(num_choices)
        ]

    def delta(self, index: int, output: RequestOutput, choice: SequenceProgress) -> BaseModel:
        """A `chat.completion.chunk` with the choice's new content and call deltas."""
        logprobs = None
        if self.with_logprobs:
            new_logprobs = output.new_logprobs or []
            logprobs = chat_logprobs(self.tokenizer, output.new_token_ids, new_logprobs)
        stream = self.tool_streams.setdefault(index, ToolCallStream())
        content, calls = output.new_text, list[CallDelta]()
        if self.reads_tool_calls:
            content, calls = stream.push(output.new_text, final=output.finished)
        finish_reason = _finish_reason(output)
        if finish_reason == "stop" and stream.num_calls:
            finish_reason = "tool_calls"
        delta = ChatDelta(content=content, tool_calls=[_call_delta(c) for c in calls] or None)
        return self._chunk(
            ChatChunkChoice(
                index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason
            )
        )

    def usage_chunk(self, usage: Usage) -> BaseModel:
        """A chunk with no choices and the usage."""
        return ChatCompletionChunk(
            id=self.response_id, created=self.created, model=self.model, choices=[], usage=usage
        )

    def response(self, choices: list[SequenceProgress]) -> BaseModel:
        """A `chat.completion` with every choice and the usage."""
        return ChatCompletionResponse(
            id=self.response_id,
            created=self.created,
            model=self.model,
            choices=[self._choice(i, c) for i, c in enumerate(choices)],
            usage=usage(choices),
        )

    def _choice(self, index: int, choice: SequenceProgress) -> ChatChoice:
        """A finished choice: its text, or the calls it made (finish_reason tool_calls)."""
        text = choice.text
        content, calls = parse_tool_calls(text) if self.reads_tool_calls else (text, [])
        finish_reason = choice.finish_reason
        if calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        tool_calls = [
            ToolCall(id=call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in calls
        ]
        logprobs = None
        if self.with_logprobs:
            logprobs = chat_logprobs(self.tokenizer, choice.token_ids, choice.logprobs)
        return ChatChoice(
            index=index,
            message=ChatResponseMessage(content=content, tool_calls=tool_calls or None),
            logprobs=logprobs,
            finish_reason=finish_reason,
        )

    def _chunk(self, choice: ChatChunkChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.response_id, created=self.created, model=self.model, choices=[choice]
        )


class CompletionEndpoint(Endpoint):
    """`/v1/completions`: raw prompts, text choices."""

    schema = CompletionRequest

    @staticmethod
    def _prompts(body: CompletionRequest, tokenizer: Any) -> list[list[int]]:
        """Each text prompt tokenized as is (no template); token-id prompts as sent, if
        every id is in the tokenizer's vocabulary."""
        prompts = []
        for prompt in body.prompt:
            if isinstance(prompt, str):
                prompts.append(tokenizer.encode(prompt))
            elif any(token >= len(tokenizer) for token in prompt):
                message = f"prompt token ids must be below the vocabulary size {len(tokenizer)}"
                raise bad_request(message, param="prompt")
            else:
                prompts.append(prompt)
        return prompts

    def delta(self, index: int, output: RequestOutput, choice: SequenceProgress) -> BaseModel:
        """A `text_completion` chunk with the choice's new text; an echoed prompt comes in
        the choice's first chunk."""
        first = len(choice.text_parts) == 1
        echo = self._echo(choice) if first else None
        offset = 0 if first else self._echo_length(choice) + len(choice.text) - len(output.new_text)
        generated = _Scored(output.new_text, output.new_token_ids, output.new_logprobs or [])
        return self._body([self._choice(index, echo, generated, offset, _finish_reason(output))])

    def usage_chunk(self, usage: Usage) -> BaseModel:
        """A chunk with no choices and the usage."""
        return self._body([], usage)

    def response(self, choices: list[SequenceProgress]) -> BaseModel:
        """A `text_completion` with every choice and the usage."""
        return self._body(
            [
                self._choice(
                    i, self._echo(c), _Scored(c.text, c.token_ids, c.logprobs), 0, c.finish_reason
                )
                for i, c in enumerate(choices)
            ],
            usage(choices),
        )

    def _choice(
        self,
        index: int,
        echo: _Scored | None,
        generated: _Scored,
        text_offset: int,
        finish_reason: str | None,
    ) -> CompletionChoice:
        """A choice of the generated part, after the echoed prompt when there is one."""
        part = generated if echo is None else echo + generated
        rendered = (
            completion_logprobs(self.tokenizer, part.token_ids, part.logprobs, text_offset)
            if self.with_logprobs
            else None
        )
        return CompletionChoice(
            index=index, text=part.text, logprobs=rendered, finish_reason=finish_reason
        )

    def _echo(self, choice: SequenceProgress) -> _Scored | None:
        """The choice's prompt with its tokens' scores, when echoing."""
        if not self.echo:
            return None
        prompt = self.echo[choice.prompt_index]
        scores = choice.prompt_logprobs or [None] * len(prompt.token_ids)
        return _Scored(prompt.text, prompt.token_ids, scores)

    def _echo_length(self, choice: SequenceProgress) -> int:
        return len(self.echo[choice.prompt_index].text) if self.echo else 0

    def _body(self, choices: list[CompletionChoice], usage: Usage | None = None) -> BaseModel:
        return CompletionResponse(
            id=self.response_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
        )


class _Scored(NamedTuple):
    """Text, its token ids and their scores (None where a token has none)."""

    text: str
    token_ids: Sequence[int]
    logprobs: Sequence[TokenLogprob | None]

    def __add__(self, other: object) -> _Scored:  # type: ignore[override]
        """This part followed by `other` (an echoed prompt, then its completion)."""
        assert isinstance(other, _Scored)
        return _Scored(
            self.text + other.text,
            [*self.token_ids, *other.token_ids],
            [*self.logprobs, *other.logprobs],
        )


def _call_delta(delta: CallDelta) -> ToolCallDelta:
    """OpenAI's shape of a call delta: id, type and name in the call's first only."""
    return ToolCallDelta(
        index=delta.index,
        id=delta.id,
        type="function" if delta.id else None,
        function=FunctionCallDelta(name=delta.name, arguments=delta.arguments),
    )


def _finish_reason(output: RequestOutput) -> str | None:
    return output.finish_reason if output.finished else None


ENDPOINTS: dict[str, type[Endpoint]] = {
    "/v1/chat/completions": ChatEndpoint,
    "/v1/completions": CompletionEndpoint,
}
"""Each completion endpoint's path: the ingress's routes and the endpoints a batch may target."""
