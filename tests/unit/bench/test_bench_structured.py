"""bench_structured builds what it runs: its engine settings, schemas, requests and the
vLLM case are valid, without running the benchmark."""

from __future__ import annotations

import json
from dataclasses import asdict

import jsonschema
import pytest

from bench.engine.peer import Case, Timing, case_params
from bench.serving import structured_workload as w
from bench.serving.bench_structured import Stream, stream_tpot_s, tpot_ms, valid_call, valid_json
from engine.grammar import GrammarCompiler, parse
from engine.sampling_params import GrammarSpec
from serving.http.engine_inputs import sampling_params
from serving.http.openai_api import ChatEndpoint, parse_body


def test_the_engine_config_is_a_batch_of_sixteen() -> None:
    config = w.engine_config()
    assert config.max_num_seqs == w.MAX_NUM_SEQS == 16


@pytest.mark.parametrize("name", list(w.SCHEMAS))
def test_each_schema_compiles_for_the_tokenizer_and_has_a_prompt(name, tokenizer) -> None:
    jsonschema.Draft202012Validator.check_schema(w.SCHEMAS[name])
    params = w.constrained_params(name, seed=1)
    assert params.grammar is not None and params.temperature == 1.0
    GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id]).compile(params.grammar)
    assert w.PROMPTS[name]


def test_free_twins_run_the_constrained_length_exactly() -> None:
    params = w.free_params(37, seed=3)
    assert (params.max_tokens, params.ignore_eos, params.grammar) == (37, True, None)
    assert w.schema_names(5) == ["person", "order", "event", "person", "order"]


def test_quick_is_smaller_in_every_measurement() -> None:
    assert all(
        q < f for q, f in zip(asdict(w.QUICK).values(), asdict(w.FULL).values(), strict=True)
    )
    assert w.FULL.num_valid_samples == 200


def test_cold_schemas_are_distinct_and_parse() -> None:
    schemas = w.random_schemas(w.QUICK.num_cold_schemas, seed=0)
    assert len({json.dumps(s, sort_keys=True) for s in schemas}) == len(schemas)
    for schema in schemas:
        parse(GrammarSpec("json_schema", json.dumps(schema)))
    assert w.random_schemas(3, seed=0) == schemas[:3]  # the same run every time


@pytest.mark.parametrize("i", [0, 1])
def test_tool_requests_are_forced_calls_the_server_accepts(i, tokenizer) -> None:
    body = parse_body(ChatEndpoint.schema, w.tool_body(i))
    assert ChatEndpoint.prompt_ids(body, tokenizer)[0]
    assert sampling_params(body, w.MAX_TOKENS).grammar is not None


def test_validity_checks_read_the_text_as_the_server_would() -> None:
    person = {"name": "Ada", "age": 36, "city": "London", "languages": ["en"]}
    assert valid_json(Stream(text=json.dumps(person), finish_reason="stop"), w.SCHEMAS["person"])
    cut = Stream(text=json.dumps(person)[:-1], finish_reason="length")
    assert not valid_json(cut, w.SCHEMAS["person"])
    call = '<tool_call>\n{"name": "book_table", "arguments": {"restaurant": "Luigi", "people": 2}}'
    text = f"{call}\n</tool_call>"
    named = w.tool_body(1)  # names book_table
    assert valid_call(named, Stream(text=text, finish_reason="stop"))
    assert not valid_call(
        w.tool_body(3), Stream(text=text.replace("book_table", "get_weather"), finish_reason="stop")
    )


def test_tpot_weighs_streams_by_their_tokens() -> None:
    streams = [
        Stream(times_s=[0.0, 0.1, 0.2], token_ids=[1, 2, 3]),
        Stream(times_s=[0.0, 0.4], token_ids=[1, 2]),
        Stream(times_s=[0.0], token_ids=[1]),
    ]
    assert tpot_ms(streams) == pytest.approx(1000 * 0.6 / 3)
    assert stream_tpot_s(Timing([2.0], output_tokens=160), batch=16) == pytest.approx(0.2)


def test_the_vllm_case_carries_its_schema_to_both_sides() -> None:
    schema = json.dumps(w.SCHEMAS["person"])
    case = Case("json_schema.c16", [[1, 2]] * 16, w.MAX_TOKENS, 16, schema, 1.0)
    job = json.loads(json.dumps(asdict(case)))  # what peer_vllm reads on stdin
    assert job["json_schema"] == schema and job["temperature"] == 1.0
    params = case_params(case)
    assert params.grammar == GrammarSpec("json_schema", schema) and not params.ignore_eos
