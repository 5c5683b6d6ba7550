"""Structured outputs and tool calls through the Serve app with the real engine (issue 29):
the `openai` client's `parse`, json_schema whole and streamed, vLLM's guided fields, tool
calls forced, offered and answered, and Batch API lines held to their grammars.

One app for the module, as for test_serving.py: `real_app_url` (tests/integration/conftest.py).
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import jsonschema
import openai
import pydantic
import pytest
from hypothesis import HealthCheck, given, settings

from testing.schemas import SCHEMAS

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


class City(pydantic.BaseModel):
    """What `chat.completions.parse` turns into a strict json_schema response_format."""

    name: str
    population: int
    coastal: bool


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    },
}


@pytest.mark.parametrize("tier", ["interactive", "batch"])
def test_parse_with_a_pydantic_model_answers_in_its_schema(
    real_client: openai.OpenAI, tier
) -> None:
    """The openai client's structured outputs, unchanged, on the speculating pool and on the
    other; sampled at temperature 1.0."""
    completion = real_client.chat.completions.parse(
        model=MODEL, messages=QUESTION, response_format=City, temperature=1.0, seed=3,
        max_tokens=80, extra_headers={"X-SLA-Tier": tier},
    )  # fmt: skip
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)


def test_json_schema_streamed_validates(real_client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 30}}}
    stream = real_client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=1.0, seed=4, max_tokens=60, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert isinstance(json.loads(text).get("answer", ""), str)


def test_a_schema_the_library_refuses_is_a_400_naming_the_field(real_client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        real_client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=5,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"type": "strin"}}},
        )  # fmt: skip
    assert caught.value.body["param"] == "response_format"


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_tool_call_comes_back_in_openais_shape(
    real_client: openai.OpenAI, stream
) -> None:
    asked = dict(
        model=MODEL, messages=QUESTION, tools=[WEATHER_TOOL], tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_tokens=60,
    )  # fmt: skip
    if stream:
        calls: dict[int, dict[str, str]] = {}
        finish_reason = None
        for chunk in real_client.chat.completions.create(stream=True, **asked):
            for delta in chunk.choices[0].delta.tool_calls or () if chunk.choices else ():
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            finish_reason = chunk.choices[0].finish_reason if chunk.choices else finish_reason
        assert finish_reason == "tool_calls"
        assert [call["name"] for call in calls.values()] == ["get_weather"]
        assert isinstance(json.loads(calls[0]["arguments"])["city"], str)
        return
    choice = real_client.chat.completions.create(**asked).choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)


def _response_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}


@settings(
    max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(schema=SCHEMAS)
def test_random_schemas_validate_whole_and_streamed(real_client: openai.OpenAI, schema) -> None:
    """Random schemas within the supported subset, sampled at temperature 1.0 through the
    server and the openai client: the answer validates, whole and streamed."""
    asked = dict(
        model=MODEL, messages=[{"role": "user", "content": "Give me a JSON object."}],
        temperature=1.0, seed=9, max_tokens=160, response_format=_response_format(schema),
    )  # fmt: skip
    whole = real_client.chat.completions.create(**asked).choices[0]
    assert whole.finish_reason == "stop", whole.message.content
    jsonschema.validate(json.loads(whole.message.content or ""), schema)
    stream = real_client.chat.completions.create(stream=True, **asked)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), schema)


def test_regex_and_choice_through_the_server(real_client: openai.OpenAI) -> None:
    """vLLM's guided_regex and guided_choice, as its clients send them (extra_body)."""
    asked = dict(model=MODEL, messages=QUESTION, temperature=1.0, seed=2, max_tokens=30)
    regex = real_client.chat.completions.create(
        extra_body={"guided_regex": r"[A-Z][a-z]{2,8}, [A-Z]{2}"}, **asked
    ).choices[0]
    assert re.fullmatch(r"[A-Z][a-z]{2,8}, [A-Z]{2}", regex.message.content or "")
    choices = ["Paris", "Lyon", "Marseille"]
    choice = real_client.chat.completions.create(extra_body={"guided_choice": choices}, **asked)
    assert choice.choices[0].message.content in choices


def test_text_that_looks_like_a_call_stays_text_without_tools(real_client: openai.OpenAI) -> None:
    """A chat offering no tools whose answer is shaped as a call (a regex makes it so)
    comes back as content: only requests with tools are read for calls."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    choice = real_client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=80, temperature=0,
        extra_body={"guided_regex": re.escape(call)},
    ).choices[0]  # fmt: skip
    assert (choice.message.content, choice.message.tool_calls) == (call, None)
    assert choice.finish_reason == "stop"


def test_a_tool_result_round_trip(real_client: openai.OpenAI) -> None:
    """The call the model made, then its result as a `tool` message: the model answers
    (auto), with the conversation rendered through the chat template."""
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = real_client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER_TOOL], tool_choice={
            "type": "function", "function": {"name": "get_weather"}},
        temperature=0, max_tokens=60,
    ).choices[0].message  # fmt: skip
    (call,) = first.tool_calls or ()
    messages += [
        first.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21, "sky": "clear"}'},
    ]
    answer = real_client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER_TOOL], temperature=0, max_tokens=30
    ).choices[0]
    assert answer.finish_reason in ("stop", "length", "tool_calls")
    assert answer.message.content or answer.message.tool_calls


CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0, "maximum": 10**8},
        "coastal": {"type": "boolean"},
    },
    "required": ["name", "population", "coastal"],
    "additionalProperties": False,
}


def _run_batch(client: openai.OpenAI, bodies: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each chat body (by custom id) as a line of one batch, run to completion: each line's
    first choice, by custom id."""
    lines = [
        json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": MODEL, "messages": QUESTION, "temperature": 1.0,
                             "seed": 5, "max_tokens": 80, **fields}})
        for custom_id, fields in bodies.items()
    ]  # fmt: skip
    uploaded = client.files.create(file=("in.jsonl", "\n".join(lines).encode()), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 180
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed"):
        assert time.monotonic() < deadline, batch.status
        time.sleep(0.5)
    assert batch.status == "completed" and batch.output_file_id, batch.errors
    output = client.files.content(batch.output_file_id).text.splitlines()
    return {r["custom_id"]: r["response"]["body"]["choices"][0] for r in map(json.loads, output)}


def test_batch_lines_carry_response_format_and_tools(real_client: openai.OpenAI) -> None:
    """Issue 29 part 5: Batch API lines with a json_schema response_format and a required
    tool call run on the batch tier held to their grammars, in OpenAI's output shapes."""
    answers = _run_batch(
        real_client,
        {
            "json": {"response_format": _response_format(CITY_SCHEMA)},
            "tool": {"tools": [WEATHER_TOOL], "tool_choice": "required",
                     "parallel_tool_calls": False},
            "plain": {"max_tokens": 8},
        },
    )  # fmt: skip
    jsonschema.validate(json.loads(answers["json"]["message"]["content"]), CITY_SCHEMA)
    (call,) = answers["tool"]["message"]["tool_calls"]
    assert answers["tool"]["finish_reason"] == "tool_calls"
    parameters = WEATHER_TOOL["function"]["parameters"]  # type: ignore[index]
    jsonschema.validate(json.loads(call["function"]["arguments"]), parameters)
    assert answers["plain"]["message"]["content"]
