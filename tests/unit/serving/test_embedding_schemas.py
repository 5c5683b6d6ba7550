"""The embeddings body: every field of the installed `openai` package's request classified,
OpenAI's four input shapes accepted, and every bad input a 400 naming its field."""

from __future__ import annotations

from typing import Any

import pytest
from openai.types import embedding_create_params

from serving.http.embedding_schemas import EMBEDDING_FIELDS, EmbeddingRequest
from serving.http.errors import ApiError
from serving.http.openai_api import parse_body
from serving.http.request_fields import Honoured


def test_every_openai_embeddings_field_is_classified() -> None:
    fields = set(embedding_create_params.EmbeddingCreateParams.__annotations__)
    assert fields <= set(EMBEDDING_FIELDS)
    honoured = {name for name, rule in EMBEDDING_FIELDS.items() if isinstance(rule, Honoured)}
    assert honoured == set(EmbeddingRequest.model_fields)


@pytest.mark.parametrize(
    ("sent", "parsed"),
    [("hi", ["hi"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]])],
)
def test_openais_four_input_shapes(sent: Any, parsed: list) -> None:
    assert parse_body(EmbeddingRequest, {"model": "m", "input": sent}).input == parsed


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"input": []}, "input", "non-empty"),
        ({"input": ""}, "input", "empty string"),
        ({"input": 5}, "input", "non-empty string or list"),
        ({"input": [1.5]}, "input", "neither a text"),
        ({"input": ["a", [1]]}, "input", "mixes texts and token ids"),
        ({"input": [[]]}, "input", "neither a text"),
        ({"input": [[-1]]}, "input", "negative"),
        ({"input": [[True]]}, "input", "neither a text"),
        ({"input": "a", "dimensions": 8}, "dimensions", "hidden size"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format", "float"),
        ({"input": "a", "n": 2}, "n", "Unrecognized"),
        ({"input": "a", "model": 3}, "model", "string"),
    ],
)
def test_bad_bodies_are_400s_naming_the_field(body: dict, param: str, says: str) -> None:
    with pytest.raises(ApiError) as refused:
        parse_body(EmbeddingRequest, {"model": "m", **body})
    assert refused.value.status == 400 and refused.value.detail.param == param
    assert says in refused.value.detail.message


def test_dimensions_null_asks_for_nothing() -> None:
    body = parse_body(EmbeddingRequest, {"model": "m", "input": "a", "dimensions": None})
    assert body.encoding_format == "float"
