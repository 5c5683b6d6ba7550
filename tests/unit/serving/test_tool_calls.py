"""Tool calling (serving/http/tool_calls.py, engine/model/chat.py): the request fields, the
Hermes rendering, forced calls through the real engine (fp32, default model), the parser
and OpenAI's response and stream shapes."""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import pytest

from engine.model.chat import chat_prompt_ids
from engine.outputs import RequestOutput
from serving.http.engine_inputs import sampling_params
from serving.http.errors import ApiError
from serving.http.openai_api import ChatEndpoint, parse_body
from serving.http.streaming import SequenceProgress
from serving.http.tool_calls import ParsedCall, ToolCallStream, parse_tool_calls

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 20}},
    "required": ["timezone"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def chat_body(**fields: Any):
    return parse_body(ChatEndpoint.schema, {"model": "m", "messages": QUESTION, **fields})


def refusal(**fields: Any) -> ApiError:
    with pytest.raises(ApiError) as caught:
        sampling_params(chat_body(**fields), 16)
    return caught.value


def generate(engine, body, max_tokens: int = 120, **params: Any) -> list[RequestOutput]:
    """The body's prompt and sampling through the engine; its deltas, in order."""
    prompt = ChatEndpoint.prompt_ids(body, engine.tokenizer)[0]
    sampling = sampling_params(body, max_tokens)
    deltas: list[RequestOutput] = []
    engine.add_request("tools", prompt, sampling)
    while engine.has_unfinished():
        deltas += engine.step()
    return deltas


def endpoint(tokenizer, body=None) -> ChatEndpoint:
    """The endpoint the ingress builds for `body` (by default one offering TOOLS)."""
    body = body or chat_body(tools=TOOLS)
    built = ChatEndpoint.for_request(body, [[1]], "chatcmpl-1", 0, "m", tokenizer)
    assert isinstance(built, ChatEndpoint)
    return built


def whole_response(tokenizer, deltas: list[RequestOutput], body=None) -> dict[str, Any]:
    choice = SequenceProgress(start_s=0.0, prompt_index=0)
    for delta in deltas:
        choice.add(delta, 0.0)
    return endpoint(tokenizer, body).response([choice]).model_dump(mode="json")["choices"][0]


def streamed_calls(
    tokenizer, deltas: list[RequestOutput], body=None
) -> tuple[str, list[dict], str | None]:
    """Content, calls and finish reason assembled from the chunks as an OpenAI client does."""
    rendering, progress = endpoint(tokenizer, body), SequenceProgress(start_s=0.0, prompt_index=0)
    content, calls, finish_reason = "", [], None
    for delta in deltas:
        progress.add(delta, 0.0)
        chunk = rendering.delta(0, delta, progress).model_dump(mode="json")["choices"][0]
        content += chunk["delta"]["content"] or ""
        for call in chunk["delta"]["tool_calls"] or ():
            if call["id"] is not None:
                assert call["index"] == len(calls) and call["function"]["name"]
                name = call["function"]["name"]
                calls.append({"id": call["id"], "name": name, "arguments": "", "pieces": 0})
            else:
                assert call["function"]["name"] is None
            calls[call["index"]]["arguments"] += call["function"]["arguments"]
            calls[call["index"]]["pieces"] += bool(call["function"]["arguments"])
        finish_reason = chunk["finish_reason"] or finish_reason
    return content, calls, finish_reason


# ---- request fields ---------------------------------------------------------------------


def test_forced_choices_become_a_grammar_and_auto_none_do_not():
    assert sampling_params(chat_body(tools=TOOLS), 16).grammar is None  # auto by default
    assert sampling_params(chat_body(tools=TOOLS, tool_choice="none"), 16).grammar is None
    assert chat_body(tools=TOOLS, tool_choice="none").offered_tools is None
    required = sampling_params(chat_body(tools=TOOLS, tool_choice="required"), 16).grammar
    named = {"type": "function", "function": {"name": "get_time"}}
    only_time = sampling_params(chat_body(tools=TOOLS, tool_choice=named), 16).grammar
    assert required is not None and only_time is not None
    assert "get_weather" in required.source and "get_weather" not in only_time.source


@pytest.mark.parametrize(
    "fields",
    [
        {"tool_choice": "required"},
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        {"tools": [{"type": "custom", "custom": {"name": "x"}}]},
        {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
    ],
)
def test_tool_requests_that_cannot_be_served_are_400s(fields):
    with pytest.raises(ApiError) as caught:
        sampling_params(chat_body(**fields), 16)
    assert caught.value.status == 400


def test_a_parameters_schema_the_library_refuses_is_a_400_naming_tool_choice():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]
    error = refusal(tools=tools, tool_choice="required")
    assert error.detail.param == "tool_choice" and "Unsupported type" in error.detail.message


def test_the_round_trip_renders_calls_and_results_through_the_template(tokenizer):
    """The assistant's call and the tool's result reach the prompt in the Hermes format."""
    call = {"id": "c1", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    messages = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C, sunny"},
    ]
    body = parse_body(ChatEndpoint.schema, {"model": "m", "messages": messages, "tools": TOOLS})
    text = tokenizer.decode(ChatEndpoint.prompt_ids(body, tokenizer)[0])
    assert '<tools>[{"type": "function", "function": {"name": "get_weather"' in text
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    )
    assert "<|im_start|>tool\n<tool_response>\n18 C, sunny\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    plain = chat_prompt_ids(tokenizer, QUESTION)
    assert ChatEndpoint.prompt_ids(chat_body(), tokenizer)[0] == plain  # no tools: unchanged


# ---- forced calls through the engine ------------------------------------------------------


@pytest.mark.slow  # left out of `make test-fast`; `make test` runs it
@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_parse_and_validate_at_temperature_one(engine, tokenizer, parallel):
    """Room for the most calls a forced output may hold (4 of about 35 tokens each)."""
    for seed in range(3):
        body = chat_body(
            tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel, seed=seed
        )
        deltas = generate(engine, body, max_tokens=200)
        choice = whole_response(tokenizer, deltas)
        assert choice["finish_reason"] == "tool_calls", choice
        calls = choice["message"]["tool_calls"]
        assert 1 <= len(calls) <= (4 if parallel else 1)
        for call in calls:
            assert call["id"].startswith("call_") and call["type"] == "function"
            name, arguments = call["function"]["name"], call["function"]["arguments"]
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_a_named_function_is_the_one_called_and_streams_as_openai_streams(engine, tokenizer):
    """Streamed: one id and name per call, arguments in several pieces that join to the
    arguments of the whole response."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = chat_body(tools=TOOLS, tool_choice=named, temperature=0)
    deltas = generate(engine, body)
    whole = [
        call["function"] for call in whole_response(tokenizer, deltas)["message"]["tool_calls"]
    ]
    assert {call["name"] for call in whole} == {"get_weather"}  # parallel: maybe several
    content, calls, finish_reason = streamed_calls(tokenizer, deltas)
    assert finish_reason == "tool_calls" and not content.strip()
    assert [call["name"] for call in calls] == [call["name"] for call in whole]
    for streamed, call in zip(calls, whole, strict=True):
        assert streamed["pieces"] > 2
        assert json.loads(streamed["arguments"]) == json.loads(call["arguments"])
        jsonschema.validate(json.loads(streamed["arguments"]), WEATHER)


def test_auto_answered_in_text_is_content_with_no_calls(engine, tokenizer):
    body = chat_body(
        messages=[{"role": "user", "content": "Write a haiku about the sea."}],
        tools=TOOLS,
        temperature=0,
    )
    deltas = generate(engine, body, max_tokens=40)
    choice = whole_response(tokenizer, deltas)
    assert choice["message"]["tool_calls"] is None and choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length")
    content, calls, _ = streamed_calls(tokenizer, deltas)
    assert content == choice["message"]["content"] and calls == []


def test_auto_parses_a_call_the_model_writes(tokenizer):
    """The parser reads what the model writes under `auto`, text before the call kept."""
    call = '{"name": "get_time", "arguments": {"timezone": "UTC"}}'
    text = f"Let me check.\n<tool_call>\n{call}\n</tool_call>"
    output = RequestOutput("r", [1], text, True, "stop", num_output_tokens=1)
    choice = whole_response(tokenizer, [output])
    assert choice["message"]["content"] == "Let me check."
    assert choice["message"]["tool_calls"][0]["function"] == {
        "name": "get_time",
        "arguments": '{"timezone": "UTC"}',
    }
    assert choice["finish_reason"] == "tool_calls"


@pytest.mark.parametrize(
    "fields", [{}, {"tools": TOOLS, "tool_choice": "none"}], ids=["no-tools", "choice-none"]
)
def test_text_that_looks_like_a_call_is_text_when_no_tools_were_offered(tokenizer, fields):
    """A plain chat (or `tool_choice: none`) is never read for calls, whole or streamed:
    a model quoting the call format answers in text."""
    body = chat_body(**fields)
    text = 'Like this:\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    outputs = [
        RequestOutput("r", [1], text[:20], False, None, num_output_tokens=1),
        RequestOutput("r", [2], text[20:], True, "stop", num_output_tokens=2),
    ]
    choice = whole_response(tokenizer, outputs, body)
    assert choice["message"] == {"role": "assistant", "content": text, "tool_calls": None}
    assert choice["finish_reason"] == "stop"
    assert streamed_calls(tokenizer, outputs, body) == (text, [], "stop")


# ---- the parser and the stream ---------------------------------------------------------------

TWO_CALLS = (
    'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, 2]}}'
    '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("plain text", ("plain text", [])),
        (
            TWO_CALLS,
            (
                "Sure.",
                [
                    ParsedCall("get_weather", '{"city": "Paris", "n": [1, 2]}'),
                    ParsedCall("get_time", "{}"),
                ],
            ),
        ),
        (
            '<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]'
            "</tool_call>",
            (None, [ParsedCall("a", "{}"), ParsedCall("b", '{"x": 1}')]),
        ),
        ("<tool_call>{not json}</tool_call>", ("<tool_call>{not json}</tool_call>", [])),
        ('<tool_call>{"name": "a"}</tool_call>', ('<tool_call>{"name": "a"}</tool_call>', [])),
        (
            '<tool_call>\n{"name": "a", "arguments": {',
            ('<tool_call>\n{"name": "a", "arguments": {', []),
        ),
    ],
)
def test_parse_tool_calls(text, expected):
    assert parse_tool_calls(text) == expected


@pytest.mark.parametrize("seed", range(20))
def test_the_stream_assembles_to_the_parsed_calls_however_the_text_is_cut(seed):
    rng = random.Random(seed)
    stream, content, calls = ToolCallStream(), "", {}
    cuts = sorted(rng.sample(range(1, len(TWO_CALLS)), 30)) + [len(TWO_CALLS)]
    start = 0
    for end in cuts:
        piece, start = TWO_CALLS[start:end], end
        new_content, deltas = stream.push(piece, final=end == len(TWO_CALLS))
        content += new_content
        for delta in deltas:
            if delta.id is not None:
                calls[delta.index] = [delta.name, ""]
            calls[delta.index][1] += delta.arguments
    expected_content, expected = parse_tool_calls(TWO_CALLS)
    assert content.strip() == expected_content
    assert [(name, json.loads(args)) for name, args in calls.values()] == [
        (call.name, json.loads(call.arguments)) for call in expected
    ]
