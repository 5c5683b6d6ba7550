"""No request field silently ignored: each is honoured, or refused with a 400 naming it.

The fields come from the installed `openai` package's own request types, so a
field a newer release adds fails here until serving/http/request_fields.py
classifies it. Bodies go through `parse_body`, what the ingress and the batch
line check call, without Ray.
"""

from __future__ import annotations

import json
import typing
from types import ModuleType
from typing import Any

import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import (
    ChatCompletionContentPartParam,
    ChatCompletionContentPartRefusalParam,
    ChatCompletionMessageParam,
    ChatCompletionStreamOptionsParam,
)
from openai.types.chat import completion_create_params as chat_params

from engine.sampling_params import GrammarSpec
from serving.http.engine_inputs import sampling_params
from serving.http.errors import ApiError
from serving.http.openai_api import ChatEndpoint, CompletionEndpoint, parse_body
from serving.http.request_fields import (
    CONTENT_PART_FIELDS,
    MESSAGE_FIELDS,
    STREAM_OPTIONS_FIELDS,
    FieldRules,
    Honoured,
    Refused,
)
from serving.http.schemas.sampling import SamplingFields

CHAT = ChatEndpoint.schema
COMPLETIONS = CompletionEndpoint.schema
CHAT_BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION_BODY = {"model": "m", "prompt": "hi"}
ENDPOINTS: dict[str, tuple[type[SamplingFields], ModuleType, dict[str, Any]]] = {
    "chat": (CHAT, chat_params, CHAT_BODY),
    "completions": (COMPLETIONS, completion_params, COMPLETION_BODY),
}

REFUSING_VALUES: dict[str, Any] = {
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    "tool_choice": "required",
    "functions": [{"name": "f", "parameters": {}}],
    "function_call": "auto",
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "known text"},
    "web_search_options": {},
    "moderation": {"model": "omni-moderation-latest"},
    "reasoning_effort": "high",
    "verbosity": "low",
    "store": True,
    "metadata": {"team": "search"},
    "service_tier": "priority",
    "safety_identifier": "user-1",
    "prompt_cache_key": "key-1",
    "prompt_cache_options": {"mode": "explicit"},
    "prompt_cache_retention": "24h",
    "echo": True,
    "best_of": 3,
    "suffix": "tail",
    "top_logprobs": 2,
    "guided_json": {"type": "object"},
    "guided_regex": "a+",
    "guided_choice": ["yes", "no"],
    "guided_grammar": 'root ::= "a"',
    "prompt_logprobs": 1,
    "priority": 1,
    # message fields
    "name": "bob",
    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    "tool_call_id": "c1",
    "refusal": "I cannot.",
    # content part fields
    "image_url": {"url": "https://example.com/cat.png"},
    "input_audio": {"data": "UklGRg==", "format": "wav"},
    "file": {"file_id": "file-1"},
    "prompt_cache_breakpoint": {"type": "ephemeral"},
    # stream options
    "include_obfuscation": True,
}
"""A realistic value of each refused field that asks for what is not served."""


def openai_fields(module: ModuleType) -> set[str]:
    """One endpoint's request parameters in the installed openai package (`stream` is
    declared on the streaming variant)."""
    base = module.CompletionCreateParamsBase.__annotations__
    return set(base) | set(module.CompletionCreateParamsStreaming.__annotations__)


def openai_keys(*union: Any) -> set[str]:
    """The fields of every TypedDict in the given openai types (unions are opened)."""
    kinds = [kind for member in union for kind in typing.get_args(member) or (member,)]
    return {key for kind in kinds for key in kind.__annotations__}


def refused(rules: FieldRules) -> list[str]:
    return [name for name, rule in rules.items() if isinstance(rule, Refused)]


def refusal(schema: type[SamplingFields], body: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse_body(schema, body)
    return caught.value


def assert_names(error: ApiError, param: str) -> None:
    """A 400 in OpenAI's shape whose `param` and message name the field."""
    body = error.body()["error"]
    assert error.status == 400 and body["type"] == "invalid_request_error"
    assert body["param"] == param and param in body["message"]


def with_message_field(name: str, value: Any) -> dict[str, Any]:
    return {**CHAT_BODY, "messages": [{"role": "assistant", "content": "hi", name: value}]}


# ---- every field classified -------------------------------------------------------


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_every_openai_request_field_is_classified(endpoint: str):
    schema, module, _ = ENDPOINTS[endpoint]
    unclassified = openai_fields(module) - set(schema.field_rules)
    assert not unclassified, f"classify in serving/http/request_fields.py: {sorted(unclassified)}"


def test_every_openai_message_content_and_stream_option_field_is_classified():
    assert openai_keys(ChatCompletionMessageParam) <= set(MESSAGE_FIELDS)
    content = openai_keys(ChatCompletionContentPartParam, ChatCompletionContentPartRefusalParam)
    assert content <= set(CONTENT_PART_FIELDS)
    assert openai_keys(ChatCompletionStreamOptionsParam) <= set(STREAM_OPTIONS_FIELDS)


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_honoured_fields_are_exactly_the_schema_fields(endpoint: str):
    """An honoured field the schema lacked would be dropped; a schema field the table
    lacked could never arrive."""
    schema, _, _ = ENDPOINTS[endpoint]
    honoured = {name for name, rule in schema.field_rules.items() if isinstance(rule, Honoured)}
    assert honoured == set(schema.model_fields)


# ---- refused fields -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "name"),
    [
        (endpoint, name)
        for endpoint, (schema, _, _) in ENDPOINTS.items()
        for name in refused(schema.field_rules)
    ],
)
def test_each_refused_field_is_a_400_naming_it(endpoint: str, name: str):
    schema, _, body = ENDPOINTS[endpoint]
    assert name in REFUSING_VALUES, f"give {name} a refusing value in REFUSING_VALUES"
    assert_names(refusal(schema, {**body, name: REFUSING_VALUES[name]}), name)


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_refused_fields_accept_values_that_ask_for_nothing(endpoint: str):
    schema, _, body = ENDPOINTS[endpoint]
    for name in refused(schema.field_rules):
        for value in schema.field_rules[name].allowed:
            assert parse_body(schema, {**body, name: value}) == parse_body(schema, body), name


def test_best_of_equal_to_n_asks_for_nothing_more():
    body = {**COMPLETION_BODY, "n": 2}
    assert parse_body(COMPLETIONS, {**body, "best_of": 2}).n == 2
    assert_names(refusal(COMPLETIONS, {**body, "best_of": 1}), "best_of")


@pytest.mark.parametrize("name", refused(MESSAGE_FIELDS))
def test_each_refused_message_field_is_a_400_naming_it(name: str):
    assert_names(
        refusal(CHAT, with_message_field(name, REFUSING_VALUES[name])), f"messages.0.{name}"
    )
    assert parse_body(CHAT, with_message_field(name, None)).messages[0].text == "hi"


@pytest.mark.parametrize("name", refused(CONTENT_PART_FIELDS))
def test_each_refused_content_part_field_is_a_400_naming_it(name: str):
    part = {"type": "text", "text": "hi", name: REFUSING_VALUES[name]}
    body = {**CHAT_BODY, "messages": [{"role": "user", "content": [part]}]}
    assert_names(refusal(CHAT, body), f"messages.0.content.0.{name}")


def test_refused_stream_option_is_a_400_naming_it():
    body = {**CHAT_BODY, "stream": True, "stream_options": {"include_obfuscation": True}}
    assert_names(refusal(CHAT, body), "stream_options.include_obfuscation")
    body["stream_options"] = {"include_usage": True, "include_obfuscation": False}
    assert parse_body(CHAT, body).include_usage_chunk


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_an_unrecognised_field_is_refused_as_openai_refuses_it(endpoint: str):
    schema, _, body = ENDPOINTS[endpoint]
    error = refusal(schema, {**body, "frobnicate": 1})
    assert_names(error, "frobnicate")
    assert "Unrecognized request argument supplied" in error.detail.message
    nested = {**CHAT_BODY, "messages": [{"role": "user", "content": "hi", "mood": "happy"}]}
    assert_names(refusal(CHAT, nested), "messages.0.mood")


# ---- honoured sampling fields ----------------------------------------------------------


def test_sampling_fields_reach_the_engine_params():
    body = parse_body(
        CHAT,
        {
            **CHAT_BODY,
            "presence_penalty": 0.5,
            "frequency_penalty": -1.25,
            "logit_bias": {"42": -100, "7": 2.5},
            "min_p": 0.1,
            "stop_token_ids": [2, 3],
            "include_stop_str_in_output": True,
            "skip_special_tokens": False,
            "user": "end-user-9",
        },
    )
    params = sampling_params(body, max_tokens=16)
    assert (params.presence_penalty, params.frequency_penalty, params.min_p) == (0.5, -1.25, 0.1)
    assert params.logit_bias == ((42, -100.0), (7, 2.5))
    assert params.stop_token_ids == (2, 3)
    assert params.include_stop_str_in_output and not params.skip_special_tokens
    assert body.user == "end-user-9"
    nulls = parse_body(CHAT, {**CHAT_BODY, "logit_bias": None, "stop_token_ids": None})
    defaults = sampling_params(nulls, max_tokens=16)
    assert (
        defaults.logit_bias == () and defaults.stop_token_ids == () and not defaults.adjusts_logits
    )


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("presence_penalty", 2.5),
        ("presence_penalty", "0.5"),
        ("frequency_penalty", -2.01),
        ("frequency_penalty", float("nan")),
        ("frequency_penalty", True),
        ("logit_bias", {"50": 100.5}),
        ("logit_bias", {"fifty": 1}),
        ("logit_bias", {"-1": 1}),
        ("logit_bias", {"5": float("inf")}),
        ("logit_bias", [5, 1]),
        ("min_p", 1.5),
        ("min_p", -0.1),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", ["2"]),
        ("include_stop_str_in_output", "yes"),
        ("skip_special_tokens", 0),
        ("user", 7),
    ],
)
def test_invalid_sampling_values_are_400s_naming_the_field(name: str, value: Any):
    for schema, _, body in ENDPOINTS.values():
        error = refusal(schema, {**body, name: value})
        assert error.status == 400 and error.detail.param is not None
        assert error.detail.param.split(".")[0] == name, error.detail


@pytest.mark.parametrize("name", ["logit_bias", "stop_token_ids"])
def test_token_ids_past_the_vocabulary_are_400s_naming_the_field(name: str, tokenizer):
    vocab = len(tokenizer)
    ids = {"logit_bias": lambda t: {str(t): 1.0}, "stop_token_ids": lambda t: [t]}[name]
    for endpoint, (schema, _, body) in zip(
        (ChatEndpoint, CompletionEndpoint), ENDPOINTS.values(), strict=True
    ):
        assert endpoint.prompt_ids(parse_body(schema, {**body, name: ids(vocab - 1)}), tokenizer)
        with pytest.raises(ApiError) as caught:
            endpoint.prompt_ids(parse_body(schema, {**body, name: ids(vocab)}), tokenizer)
        assert_names(caught.value, name)


# ---- structured outputs ------------------------------------------------------------------

PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("response_format", {"type": "json_object"}, GrammarSpec("json_object")),
        (
            "response_format",
            {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}},
            GrammarSpec("json_schema", json.dumps(PERSON), strict=True),
        ),
        ("guided_json", PERSON, GrammarSpec("json_schema", json.dumps(PERSON), strict=False)),
        ("guided_json", json.dumps(PERSON), GrammarSpec("json_schema", json.dumps(PERSON), False)),
        ("guided_regex", "[a-z]+", GrammarSpec("regex", "[a-z]+")),
        ("guided_choice", ["yes", "no"], GrammarSpec("choice", '["yes", "no"]')),
        ("guided_grammar", 'root ::= "a"', GrammarSpec("ebnf", 'root ::= "a"')),
    ],
)
def test_grammar_fields_reach_the_engine_params(field: str, value: Any, expected: GrammarSpec):
    for schema, _, body in ENDPOINTS.values():
        assert sampling_params(parse_body(schema, {**body, field: value}), 16).grammar == expected
    text = parse_body(CHAT, {**CHAT_BODY, "response_format": {"type": "text"}})
    assert sampling_params(text, 16).grammar is None


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("guided_json", {"type": "strin"}, "Unsupported type"),
        ("guided_regex", "[a-", "Unclosed"),
        ("guided_grammar", "root ::= foo", "not defined"),
        (
            "response_format",
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}},
            "Type should be a string",
        ),
    ],
)
def test_a_grammar_the_library_refuses_is_a_400_naming_the_field(field, value, reason):
    body = parse_body(CHAT, {**CHAT_BODY, field: value})
    with pytest.raises(ApiError) as caught:
        sampling_params(body, 16)
    assert_names(caught.value, field)
    assert reason in caught.value.detail.message


def test_one_grammar_at_a_time():
    body = {**CHAT_BODY, "guided_regex": "a+", "response_format": {"type": "json_object"}}
    error = refusal(CHAT, body)
    assert error.status == 400 and "guided_regex" in error.detail.message
    schema_without_format = {"type": "json_schema"}
    assert refusal(CHAT, {**CHAT_BODY, "response_format": schema_without_format}).status == 400
