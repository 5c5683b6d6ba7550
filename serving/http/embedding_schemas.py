"""`POST /v1/embeddings` in OpenAI's shape: its fields, classified, and its bodies.

`input` is a string, a list of strings, a list of token ids, or a list of token-id
lists, as OpenAI takes it; each becomes one vector. `encoding_format` is `float`
(JSON numbers) or `base64` (the little-endian float32 bytes, which the `openai`
client asks for by default and decodes with numpy). `dimensions` is refused: the
vectors are the model's hidden size, and cutting a mean-pooled vector short is not
a smaller embedding of the same text (only models trained for it, Matryoshka-style,
keep their meaning that way).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict

from serving.http.request_fields import FieldRules, Honoured, Refused

EMBEDDING_FIELDS: FieldRules = {
    **dict.fromkeys(("model", "input", "encoding_format", "user", "tier"), Honoured()),
    "dimensions": Refused(
        "embeddings are the model's hidden size; a shorter vector is not served "
        "(this model was not trained to be cut). Leave dimensions out."
    ),
}
"""Every field of OpenAI's embeddings request, and tierserve's `tier`."""


def _inputs(value: Any) -> list[str] | list[list[int]]:
    """OpenAI's four shapes of `input` as a list of texts or of token-id lists; a
    ValueError (a 400 naming `input`) that says what is wrong otherwise."""
    if isinstance(value, str) or (value and isinstance(value, list) and all(map(_is_int, value))):
        value = [value]  # one text, or one list of token ids
    if not isinstance(value, list) or not value:
        raise ValueError(f"must be a non-empty string or list; {_SHAPES}")
    if all(isinstance(item, str) for item in value):
        if empty := [i for i, item in enumerate(value) if not item]:
            raise ValueError(f"item {empty[0]} is an empty string")
        return value
    if any(isinstance(item, str) for item in value):
        raise ValueError("mixes texts and token ids; send one kind")
    for i, item in enumerate(value):
        if not isinstance(item, list) or not item or not all(map(_is_int, item)):
            raise ValueError(
                f"item {i} is neither a text nor a non-empty list of token ids; {_SHAPES}"
            )
        if min(item) < 0:
            raise ValueError(f"item {i} has a negative token id")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_SHAPES = "send a string, a list of strings, a list of token ids or a list of token-id lists"


class EmbeddingRequest(BaseModel):
    """The body of `POST /v1/embeddings`; strict types, no field beyond these."""

    model_config = ConfigDict(strict=True, extra="forbid")
    field_rules: ClassVar[FieldRules] = EMBEDDING_FIELDS

    model: str
    input: Annotated[list[Any], BeforeValidator(_inputs)]
    """Non-empty texts, or non-empty lists of token ids (not mixed)."""
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None
    """OpenAI's end-user id: written to the request log."""
    tier: str | None = None
    """tierserve's SLA tier; the `X-SLA-Tier` header wins over it."""


class Embedding(BaseModel):
    """One input's vector, by its index in `input`."""

    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str
    """Numbers, or base64 of their little-endian float32 bytes."""


class EmbeddingUsage(BaseModel):
    """Tokens read: an embedding generates none, so the total is the prompt's."""

    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    """OpenAI's `list` of embeddings."""

    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
