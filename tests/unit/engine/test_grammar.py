"""Constrained decoding (engine/grammar.py): what the grammar allows is all that comes out,
through the real engine on the default model (fp32), with and without speculation."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig, SpecDecodeConfig
from engine.engine import LLMEngine
from engine.grammar import GrammarCompiler, GrammarState, mask_logits, parse
from engine.model.chat import chat_prompt_ids
from engine.sampler import SampleRow, verify
from engine.sampling_params import GrammarSpec, SamplingParams
from testing.engine_helpers import TEST_ENGINE_CONFIG, greedy, run_one, run_requests
from testing.schemas import SCHEMAS

# ---- fixtures -----------------------------------------------------------------


@pytest.fixture(scope="module")
def spec_engine() -> LLMEngine:
    """An engine that speculates by prompt lookup (4 drafts a step)."""
    return LLMEngine(EngineConfig(**TEST_ENGINE_CONFIG, spec_decode=SpecDecodeConfig()))


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def constrained(kind: str, source: str = "", **kwargs) -> SamplingParams:
    return SamplingParams(grammar=GrammarSpec(kind, source), **kwargs)  # type: ignore[arg-type]


# ---- the engine's output obeys the grammar ------------------------------------


@settings(
    max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@pytest.mark.slow  # left out of `make test-fast`; `make test` runs it
@given(schemas=st.lists(SCHEMAS, min_size=4, max_size=4), seed=st.integers(0, 2**32))
def test_sampled_json_validates_against_random_schemas(engine, schemas, seed):
    """Four random schemas in one batch at temperature 1.0: every output parses and
    validates, and ends by the grammar (finish_reason stop), not by the length limit."""
    prompt = chat_prompt_ids(engine.tokenizer, "Give me a JSON object.")
    requests = {
        f"s{i}": (
            prompt,
            constrained(
                "json_schema", json.dumps(schema), max_tokens=160, temperature=1.0, seed=seed + i
            ),
        )
        for i, schema in enumerate(schemas)
    }
    outputs = run_requests(engine, requests)
    for i, schema in enumerate(schemas):
        completion = outputs[f"s{i}"]
        assert completion.finish_reason == "stop", (schema, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)


def test_json_object_regex_choice_and_ebnf(engine):
    """Each kind of grammar, sampled at temperature 1.0 in one batch, and ended by it (any
    JSON object gets room to nest)."""
    prompt = chat_prompt_ids(engine.tokenizer, "Answer briefly.")
    cases = {
        "object": constrained("json_object", max_tokens=300),
        "regex": constrained("regex", r"[A-Z][a-z]{2,6}-\d{2}"),
        "choice": constrained("choice", json.dumps(["yes", "no", "it depends"])),
        "ebnf": constrained("ebnf", 'root ::= "(" [0-9]+ (" + " [0-9]+)* ")"'),
    }
    requests = {
        name: (prompt, replace(params, max_tokens=max(params.max_tokens, 60), seed=7))
        for name, params in cases.items()
    }
    outputs = run_requests(engine, requests)
    assert all(c.finish_reason == "stop" for c in outputs.values()), outputs
    assert isinstance(json.loads(outputs["object"].text), dict)
    assert re.fullmatch(r"[A-Z][a-z]{2,6}-\d{2}", outputs["regex"].text)
    assert outputs["choice"].text in ("yes", "no", "it depends")
    assert re.fullmatch(r"\(\d+( \+ \d+)*\)", outputs["ebnf"].text)


@pytest.mark.slow  # left out of `make test-fast`; `make test` runs it
def test_seeded_constrained_request_is_reproducible_in_a_busy_batch(engine):
    """The mask depends on the request's own tokens only: alone or beside others, cold or
    warm, a seeded constrained request returns the same tokens."""
    prompt = chat_prompt_ids(engine.tokenizer, "A person as JSON.")
    params = constrained("json_object", max_tokens=48, temperature=1.0, seed=11)
    alone = run_one(engine, prompt, params).token_ids
    busy = {f"other{i}": (prompt, SamplingParams(max_tokens=30, seed=i)) for i in range(5)}
    beside = run_requests(engine, {**busy, "mine": (prompt, params)})["mine"].token_ids
    assert beside == alone == run_one(engine, prompt, params).token_ids


# ---- speculation stays exact --------------------------------------------------

ECHO_PROMPT = (
    'Copy this JSON exactly: {"name": "Elsmere", "boats": 40, "fish": ["cod", "herring"], '
    '"open": true}'
)
ECHO_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "boats": {"type": "integer"},
        "fish": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        "open": {"type": "boolean"},
    },
    "required": ["name", "boats", "fish", "open"],
}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_prompt_lookup_gives_the_output_of_plain_decoding(engine, spec_engine, temperature):
    """With a grammar, prompt-lookup drafts (many of them accepted here: the prompt holds
    the answer) change nothing in what a greedy or seeded request returns."""
    prompt = chat_prompt_ids(engine.tokenizer, ECHO_PROMPT)
    params = constrained(
        "json_schema", json.dumps(ECHO_SCHEMA), max_tokens=80, temperature=temperature, seed=5
    )
    before = spec_engine.stats().spec_num_accepted_tokens or 0
    speculated = run_one(spec_engine, prompt, params)
    assert (spec_engine.stats().spec_num_accepted_tokens or 0) > before
    assert speculated.token_ids == run_one(engine, prompt, params).token_ids
    jsonschema.validate(json.loads(speculated.text), ECHO_SCHEMA)


def test_verify_rejects_a_draft_the_grammar_forbids(compiler, tokenizer):
    """The raw logits favour the draft everywhere, the grammar forbids it: it is rejected,
    the correction is allowed, and the matcher holds exactly the emitted token."""
    grammar = GrammarState(compiler.compile(GrammarSpec("choice", '["yes"]')))
    forbidden = tokenizer.encode("no", add_special_tokens=False)[0]
    logits = torch.zeros(3, len(tokenizer))
    logits[:, forbidden] = 50.0
    row = SampleRow(greedy(4), 0, [], 0, (), grammar=grammar)
    tokens, _ = verify(logits, row, [forbidden, forbidden])
    assert len(tokens) == 1 and tokens[0] != forbidden
    emitted = tokenizer.decode(tokens)
    assert "yes".startswith(emitted)
    for token in tokenizer.encode("yes"[len(emitted) :], add_special_tokens=False):
        grammar.accept(token)  # the matcher is right after the emitted token
    grammar.accept(tokenizer.eos_token_id)
    assert grammar.is_terminated


# ---- refusals -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (GrammarSpec("json_schema", '{"type": "strin"}'), "Unsupported type"),
        (GrammarSpec("json_schema", "{not json"), "parse JSON"),
        (GrammarSpec("regex", "[a-"), "Unclosed"),
        (GrammarSpec("ebnf", "root ::= foo"), "not defined"),
        (GrammarSpec("choice", "[]"), "non-empty"),
    ],
)
def test_a_grammar_that_cannot_compile_is_a_value_error(spec, message, engine):
    """Refused with the library's reason, before anything is queued; the engine goes on."""
    with pytest.raises(ValueError, match=message):
        parse(spec)
    with pytest.raises(ValueError, match="grammar"):
        engine.add_request("bad", [1, 2, 3], SamplingParams(grammar=spec))
    assert not engine.has_unfinished() and "bad" not in engine.requests


def test_compiled_grammars_are_cached_by_content(compiler):
    spec = GrammarSpec("json_schema", json.dumps(ECHO_SCHEMA))
    assert compiler.compile(spec) is compiler.compile(GrammarSpec(**spec.__dict__))


def test_unconstrained_rows_are_left_untouched(compiler, tokenizer):
    """Only the constrained row is masked; a batch without grammars is the same tensor."""
    logits = torch.randn(2, len(tokenizer))
    assert mask_logits(logits, [None, None]) is logits
    grammar = GrammarState(compiler.compile(GrammarSpec("regex", "[0-9]")))
    masked = mask_logits(logits, [None, grammar])
    assert torch.equal(masked[0], logits[0])
    assert 0 < int(masked[1].isfinite().sum()) <= 10
