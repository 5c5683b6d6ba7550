"""Every request field, classified once: honoured, or refused with a 400 naming it.

A client that sends a field expects it to mean something. OpenAI itself
refuses arguments it does not recognise; an OpenAI-compatible server that
silently drops one (`response_format`, `tools`, `logit_bias`) answers a
question that was not asked. So each field of OpenAI's chat and text
completion requests, and each extra that vLLM clients send, is in one of
these tables:

- `Honoured`: a field of the body schema (serving/http/schemas/), served.
- `Refused`: a 400 naming the field, unless its value asks for nothing
  tierserve does not already do (null, an empty list, the default), in which
  case it is dropped.

A field in no table is refused as OpenAI refuses it ("Unrecognized request
argument supplied"). The tables reach into messages and stream options, so
nothing nested is ignored either. tests/unit/serving/test_request_fields.py reads the
installed `openai` package's request types and fails on any field missing
here: a newer release cannot add one that is silently ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias


@dataclass(frozen=True)
class Honoured:
    """Served as asked; `parts` classifies the fields of the object the value is (or of
    each object in the list it is): a message, the stream options."""

    parts: Mapping[str, Rule] | None = None


@dataclass(frozen=True)
class Refused:
    """Not served: any value but the `allowed` ones (which ask for nothing) is a 400."""

    why: str
    """Completes the 400's message: what is not served, and what to send instead."""
    allowed: tuple[Any, ...] = (None,)
    same_as: str | None = None
    """A field whose value (default 1) this one may also equal: `best_of` equal to `n`
    asks for nothing more than `n` does."""

    def allows(self, value: Any, body: Mapping[str, Any]) -> bool:
        """Whether `value` asks for nothing tierserve does not already do."""
        if self.same_as is not None and _same(value, body.get(self.same_as) or 1):
            return True
        return any(_same(value, allowed) for allowed in self.allowed)


Rule: TypeAlias = Honoured | Refused
FieldRules: TypeAlias = Mapping[str, Rule]


class FieldRefused(ValueError):
    """A field the request may not carry (or may not carry with this value)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def served_fields(rules: FieldRules, body: Mapping[str, Any], path: str = "") -> dict[str, Any]:
    """The body without its harmless refused fields, every field checked
    against `rules`; FieldRefused names the first that asks for what is not served. Values
    of the wrong type are left to the schema to refuse."""
    served: dict[str, Any] = {}
    for name, value in body.items():
        param = f"{path}{name}"
        rule = rules.get(name)
        if rule is None:
            raise FieldRefused(f"Unrecognized request argument supplied: {param}", param)
        if isinstance(rule, Refused) and not rule.allows(value, body):
            raise FieldRefused(f"{param}: {rule.why}", param)
        if isinstance(rule, Honoured):
            served[name] = _served_parts(rule.parts, value, param)
    return served


def _served_parts(parts: FieldRules | None, value: Any, param: str) -> Any:
    """The value with the objects it holds checked against `parts` (none: as it is)."""
    if parts is None:
        return value
    if isinstance(value, Mapping):
        return served_fields(parts, value, f"{param}.")
    if isinstance(value, list):
        return [_served_parts(parts, item, f"{param}.{i}") for i, item in enumerate(value)]
    return value


def _same(value: Any, allowed: Any) -> bool:
    """Equal and of the same JSON type: `0` is not `false`, `1.0` is not `1`."""
    return type(value) is type(allowed) and value == allowed


_NOT_RENDERED = "is not rendered by the chat template: the model would never see it."
_NO_CUSTOM_TOOLS = "custom (free-text) tools are not served; send function tools."
_NO_FUNCTIONS = "the deprecated functions API is not served; send tools and tool_choice."

_TEXT_ONLY = "the models here read text only."

CONTENT_PART_FIELDS: FieldRules = {
    "type": Honoured(),
    "text": Honoured(),
    "image_url": Refused(_TEXT_ONLY),
    "input_audio": Refused(_TEXT_ONLY),
    "file": Refused(_TEXT_ONLY),
    "refusal": Refused(f"an assistant's refusal {_NOT_RENDERED}"),
    "prompt_cache_breakpoint": Refused("the prefix cache matches prompts by content alone."),
}
"""The fields of one part of a message's content."""

FUNCTION_FIELDS: FieldRules = dict.fromkeys(
    ("name", "description", "parameters", "strict"), Honoured()
)
"""The fields of a function tool's `function` (its parameters schema is the grammar's)."""

TOOL_FIELDS: FieldRules = {
    "type": Honoured(),
    "function": Honoured(FUNCTION_FIELDS),
    "custom": Refused(_NO_CUSTOM_TOOLS),
}
"""The fields of one of `tools`."""

TOOL_CALL_FIELDS: FieldRules = {
    "id": Honoured(),
    "type": Honoured(),
    "function": Honoured(),
    "custom": Refused(_NO_CUSTOM_TOOLS),
}
"""The fields of one of an assistant message's `tool_calls`."""

MESSAGE_FIELDS: FieldRules = {
    "role": Honoured(),
    "content": Honoured(CONTENT_PART_FIELDS),
    "name": Refused(f"a participant name {_NOT_RENDERED}"),
    "tool_calls": Honoured(TOOL_CALL_FIELDS),
    "tool_call_id": Honoured(),
    "function_call": Refused(f"an assistant's function call {_NOT_RENDERED}"),
    "refusal": Refused(f"an assistant's refusal {_NOT_RENDERED}"),
    "audio": Refused(f"an assistant's audio {_NOT_RENDERED}"),
}
"""The fields of one chat message (every role's)."""

JSON_SCHEMA_FIELDS: FieldRules = dict.fromkeys(
    ("name", "description", "schema", "strict"), Honoured()
)
"""The fields of `response_format.json_schema` (the schema itself is the grammar's)."""

RESPONSE_FORMAT_FIELDS: FieldRules = {
    "type": Honoured(),
    "json_schema": Honoured(JSON_SCHEMA_FIELDS),
}

STREAM_OPTIONS_FIELDS: FieldRules = {
    "include_usage": Honoured(),
    "include_obfuscation": Refused("streams are not obfuscated; send false.", (None, False)),
}

_SHARED_FIELDS: FieldRules = {
    **dict.fromkeys(
        (
            "model",
            "n",
            "stream",
            "temperature",
            "top_p",
            "seed",
            "stop",
            "max_tokens",
            "logprobs",
            "presence_penalty",
            "frequency_penalty",
            "logit_bias",
            "tier",
            "cache",  # false: this request skips the semantic cache (serving/cache/)
            "user",  # written to the request log (serving/telemetry.py)
            # vLLM's sampling extras
            "top_k",
            "min_p",
            "min_tokens",
            "repetition_penalty",
            "ignore_eos",
            "stop_token_ids",
            "include_stop_str_in_output",
            "skip_special_tokens",
        ),
        Honoured(),
    ),
    "stream_options": Honoured(STREAM_OPTIONS_FIELDS),
    # Structured outputs: a grammar the engine's sampler enforces (engine/grammar.py)
    "response_format": Honoured(RESPONSE_FORMAT_FIELDS),
    **dict.fromkeys(("guided_json", "guided_regex", "guided_choice", "guided_grammar"), Honoured()),
    "prompt_logprobs": Refused(
        "prompt log-probabilities come with echo and logprobs on /v1/completions."
    ),
    "priority": Refused("the SLA tier (`tier`, X-SLA-Tier) sets priority.", (None, 0)),
}

CHAT_FIELDS: FieldRules = {
    **_SHARED_FIELDS,
    "messages": Honoured(MESSAGE_FIELDS),
    "max_completion_tokens": Honoured(),
    "top_logprobs": Honoured(),
    # Tool calling: serving/http/tool_calls.py
    "tools": Honoured(TOOL_FIELDS),
    "tool_choice": Honoured(),
    "parallel_tool_calls": Honoured(),
    "functions": Refused(_NO_FUNCTIONS, (None, [])),
    "function_call": Refused(_NO_FUNCTIONS, (None, "none")),
    "audio": Refused("audio output is not served; the models here write text."),
    "modalities": Refused('only text is served; send ["text"].', (None, ["text"])),
    "prediction": Refused("predicted outputs are not served."),
    "web_search_options": Refused("web search is not served."),
    "moderation": Refused("moderation is not served."),
    "reasoning_effort": Refused("the models here do not reason first.", (None, "none")),
    "verbosity": Refused("verbosity cannot be set for the models here."),
    "store": Refused("completions are not stored.", (None, False)),
    "metadata": Refused("metadata is kept only with stored completions, and none are stored."),
    "service_tier": Refused(
        "the SLA tier is set by `tier` or the X-SLA-Tier header.", (None, "auto", "default")
    ),
    "safety_identifier": Refused("no abuse detection runs on it; `user` is logged."),
    "prompt_cache_key": Refused("the prefix cache matches prompts by content, not by key."),
    "prompt_cache_options": Refused("the prefix cache has no breakpoints or lifetimes to set."),
    "prompt_cache_retention": Refused(
        "cached prefixes are kept in memory only.", (None, "in_memory")
    ),
    "echo": Refused("echo is served on /v1/completions only.", (None, False)),
}
"""`POST /v1/chat/completions`."""

COMPLETION_FIELDS: FieldRules = {
    **_SHARED_FIELDS,
    "prompt": Honoured(),
    "echo": Honoured(),
    "best_of": Refused("every sampled sequence is returned: best_of must equal n.", same_as="n"),
    "suffix": Refused("insertion (text after the completion) is not served.", (None, "")),
    "top_logprobs": Refused("completions take the number of alternatives in `logprobs`."),
}
"""`POST /v1/completions`."""
