"""What bench_structured runs: the JSON schemas, prompts and tool requests, the engine's
settings, and random schemas for the compile timings. Built without running anything, so
tests/unit/bench/test_bench_structured.py checks every piece is valid.

The schemas bound every string and array (maxLength, maxItems), as a client that wants an
answer does: at temperature 1.0 a small model otherwise writes until max_tokens, and an
unfinished object is counted invalid.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig, auto_dtype_name
from engine.sampling_params import GrammarSpec, SamplingParams

MAX_TOKENS = 160
"""Room for the largest bounded schema below; a request that reaches it is invalid."""
MAX_NUM_SEQS = 16
"""The batch of the c16 case."""

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"type": "string", "maxLength": 20},
            "languages": {
                "type": "array",
                "items": {"type": "string", "maxLength": 12},
                "maxItems": 3,
            },
        },
        "required": ["name", "age", "city", "languages"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 99999},
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "product": {"type": "string", "maxLength": 16},
                        "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["product", "quantity"],
                    "additionalProperties": False,
                },
                "maxItems": 3,
            },
            "paid": {"type": "boolean"},
        },
        "required": ["id", "items", "paid"],
        "additionalProperties": False,
    },
    "event": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 30},
            "day": {"enum": ["monday", "tuesday", "wednesday", "thursday", "friday"]},
            "attendees": {"type": "integer", "minimum": 0, "maximum": 500},
            "online": {"type": "boolean"},
        },
        "required": ["title", "day", "attendees", "online"],
        "additionalProperties": False,
    },
}
"""The decode workload: each prompt asks for one of these."""

PROMPTS = {
    "person": "Invent a person and describe them as JSON.",
    "order": "Write a small shop order as JSON.",
    "event": "Describe a meeting next week as JSON.",
}

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "book_table",
            "description": "Book a restaurant table",
            "parameters": {
                "type": "object",
                "properties": {
                    "restaurant": {"type": "string", "maxLength": 20},
                    "people": {"type": "integer", "minimum": 1, "maximum": 12},
                },
                "required": ["restaurant", "people"],
            },
        },
    },
]
TOOL_QUESTIONS = (
    "What is the weather like in Lisbon?",
    "Book a table for four at Nando's tonight.",
    "Is it raining in Oslo right now?",
    "I need dinner for two at Luigi's.",
)


@dataclass(frozen=True)
class Sizes:
    """How much of each measurement a run makes."""

    num_valid_samples: int
    """Constrained requests at c16 (their outputs are the valid-rate sample too)."""
    num_c1_requests: int
    num_cold_schemas: int
    num_tool_requests: int


FULL = Sizes(num_valid_samples=200, num_c1_requests=8, num_cold_schemas=60, num_tool_requests=48)
QUICK = Sizes(num_valid_samples=48, num_c1_requests=4, num_cold_schemas=20, num_tool_requests=16)


def engine_config() -> EngineConfig:
    """The engine both runs share: the default model in the pools' dtype, a batch of 16."""
    return EngineConfig(dtype=auto_dtype_name(), max_num_seqs=MAX_NUM_SEQS, kv_cache_memory_gb=1.0)


def schema_names(count: int) -> list[str]:
    """Which schema each of `count` requests asks for, in turn."""
    names = list(SCHEMAS)
    return [names[i % len(names)] for i in range(count)]


def constrained_params(name: str, seed: int) -> SamplingParams:
    """Temperature 1.0, seeded, held to schema `name` (compact JSON, strict)."""
    spec = GrammarSpec("json_schema", json.dumps(SCHEMAS[name]), strict=True)
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, grammar=spec)


def free_params(num_tokens: int, seed: int) -> SamplingParams:
    """The same draw without a grammar, made to run exactly `num_tokens` tokens: the
    constrained request's length, so both runs decode the same amount."""
    return SamplingParams(max_tokens=num_tokens, temperature=1.0, seed=seed, ignore_eos=True)


def tool_body(i: int) -> dict[str, Any]:
    """The i-th tool request: `required` and a named function in turn, no parallel calls."""
    named = {"type": "function", "function": {"name": TOOLS[i % 2]["function"]["name"]}}
    return {
        "model": "default",
        "messages": [{"role": "user", "content": TOOL_QUESTIONS[i % len(TOOL_QUESTIONS)]}],
        "tools": TOOLS,
        "tool_choice": "required" if i % 2 == 0 else named,
        "parallel_tool_calls": False,
        "temperature": 1.0,
        "seed": i,
        "max_tokens": MAX_TOKENS,
    }


def random_schemas(count: int, seed: int) -> list[dict[str, Any]]:
    """`count` distinct object schemas (2-5 properties of bounded leaves): grammars no cache
    has seen, for the cold compile time."""
    rng = random.Random(seed)
    schemas: dict[str, dict[str, Any]] = {}
    while len(schemas) < count:
        names = rng.sample(["a", "b", "c", "d", "e", "f", "g", "h", "i", "j"], rng.randint(2, 5))
        schema = {
            "type": "object",
            "properties": {name: _random_leaf(rng) for name in names},
            "required": sorted(rng.sample(names, rng.randint(1, len(names)))),
        }
        schemas[json.dumps(schema, sort_keys=True)] = schema
    return list(schemas.values())


def _random_leaf(rng: random.Random) -> dict[str, Any]:
    """A bounded string, integer range, boolean, enum or array of strings."""
    kind = rng.randrange(5)
    if kind == 0:
        return {"type": "string", "maxLength": rng.randint(1, 40)}
    if kind == 1:
        low = rng.randint(-100, 100)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 1000)}
    if kind == 2:
        return {"type": "boolean"}
    if kind == 3:
        return {"enum": rng.sample(["x", "y", "z", "w", "v"], rng.randint(1, 4))}
    items = {"type": "string", "maxLength": rng.randint(1, 10)}
    return {"type": "array", "items": items, "maxItems": rng.randint(1, 4)}
