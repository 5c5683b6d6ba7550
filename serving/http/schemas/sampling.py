"""The fields every completion request shares: sampling, stops, output grammars, tier.

Beside OpenAI's fields, requests carry the sampling extras that vLLM clients and
benchmark tools send (`top_k`, `min_p`, `min_tokens`, `ignore_eos`,
`repetition_penalty`, `stop_token_ids`, `include_stop_str_in_output`,
`skip_special_tokens`), the output grammars (`response_format`, vLLM's
`guided_*`: one at most) and tierserve's `tier`.

Fields are strict: numbers must be JSON numbers (not strings or booleans),
finite and in range, so nothing the sampler cannot use gets past the
ingress, and every refusal names its field. The bounds that are config (how
many prompts, stop strings) are checked by serving/http/limits.py; token ids
against the vocabulary where the prompt is tokenized (serving/http/engine_inputs.py).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from engine.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_PENALTY,
    SEED_MAX,
    SEED_MIN,
    GrammarKind,
    GrammarSpec,
)
from serving.http.request_fields import FieldRules


def as_list(value: Any) -> Any:
    """OpenAI lets one string stand for a list of one; null stands for none."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else value


Finite = Annotated[float, Field(allow_inf_nan=False)]
Penalty = Annotated[Finite, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)]
TokenIds = list[Annotated[int, Field(ge=0)]]
StrList = Annotated[list[str], BeforeValidator(as_list)]
LogitBias = dict[
    Annotated[str, Field(pattern=r"^[0-9]{1,9}$")],
    Annotated[Finite, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)],
]
"""OpenAI's shape: a token id (as a JSON object key, a string of digits) to a bias."""


class StrictModel(BaseModel):
    """Base of request bodies: strict types; a field the schema lacks is an error (the
    request_fields tables refuse it first, with a message saying why)."""

    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(StrictModel):
    """OpenAI's stream options: only `include_usage` is honoured."""

    include_usage: bool = False


class JsonSchemaFormat(StrictModel):
    """`response_format.json_schema`: OpenAI's named schema for structured outputs."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None
    """No property beyond the schema's (OpenAI's default is false)."""


class ResponseFormat(StrictModel):
    """OpenAI's `response_format`: free text, any JSON object, or JSON of a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with, and only with, type json_schema")
        return self

    @property
    def grammar(self) -> GrammarSpec | None:
        """The output grammar it asks for (none for text)."""
        if self.json_schema is not None:
            schema = json.dumps(self.json_schema.schema_)
            return GrammarSpec("json_schema", schema, strict=bool(self.json_schema.strict))
        return GrammarSpec("json_object") if self.type == "json_object" else None


class SamplingFields(StrictModel):
    """Fields shared by chat and text completion requests."""

    field_rules: ClassVar[FieldRules]
    """Every field a body of this endpoint may carry, classified (request_fields)."""

    model: str
    n: int = Field(default=1, ge=1)
    """Choices per prompt; n x prompts is bounded by the config's max_sequences."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Finite = Field(default=1.0, ge=0)
    top_p: Finite = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=-1)
    """0 or -1 turn top-k off."""
    min_tokens: int = Field(default=0, ge=0)
    repetition_penalty: Finite = Field(default=1.0, gt=0)
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: LogitBias | None = None
    """Token ids are checked against the vocabulary where the prompt is tokenized."""
    min_p: Finite = Field(default=0.0, ge=0, le=1)
    ignore_eos: bool = False
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: StrList = Field(default_factory=list)
    """Stop strings; one string or null are accepted, as OpenAI does."""
    stop_token_ids: TokenIds | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    tier: str | None = None
    """tierserve's SLA tier; the `X-SLA-Tier` header wins over it."""
    cache: bool = True
    """false: neither answered from nor stored in the semantic cache (serving/cache/)."""
    user: str | None = None
    """OpenAI's id of the caller's end user: written to the request log."""
    max_tokens: int | None = Field(default=None, ge=1)
    """None means the rest of the context, as vLLM does."""
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    """vLLM's: a JSON schema, as an object or as JSON text."""
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = None
    """vLLM's: an EBNF grammar (xgrammar's dialect)."""

    @model_validator(mode="after")
    def _one_grammar(self) -> SamplingFields:
        asked = self.grammar_params()
        if len(asked) > 1:
            raise ValueError(f"only one of {', '.join(asked)} may constrain the output")
        return self

    def grammar_params(self) -> list[str]:
        """The fields that ask for an output grammar (at most one passes validation)."""
        asked = {
            "response_format": self.response_format is not None
            and self.response_format.type != "text",
            "guided_json": self.guided_json is not None,
            "guided_regex": self.guided_regex is not None,
            "guided_choice": self.guided_choice is not None,
            "guided_grammar": self.guided_grammar is not None,
        }
        return [param for param, given in asked.items() if given]

    def grammar_of(self, param: str) -> GrammarSpec:
        """The grammar field `param` asks for (ValueError when it cannot be built)."""
        if param == "response_format":
            assert self.response_format is not None and self.response_format.grammar
            return self.response_format.grammar
        if param == "guided_json":
            schema = self.guided_json
            text = schema if isinstance(schema, str) else json.dumps(schema)
            return GrammarSpec("json_schema", text, strict=False)
        if param == "guided_choice":
            return GrammarSpec("choice", json.dumps(self.guided_choice))
        kind: GrammarKind = "regex" if param == "guided_regex" else "ebnf"
        return GrammarSpec(kind, getattr(self, param))

    @property
    def requested_max_tokens(self) -> int | None:
        """The output length the client asked for; None: the rest of the context."""
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per token to return log-probabilities of (0: the chosen token's
        alone; None: no logprobs), whatever the endpoint calls the fields."""
        return None

    @property
    def echoed_prompts(self) -> list[str] | list[TokenIds]:
        """Prompts to repeat before their completions (`echo`); none by default."""
        return []

    @property
    def routing_text(self) -> str:
        """What the difficulty router reads: the request's own words, without a template."""
        return ""

    @property
    def include_usage_chunk(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage
