"""`POST /v1/completions`: raw prompts, as text or token ids, and `echo`."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field

from engine.sampling_params import MAX_TOP_LOGPROBS
from serving.http.request_fields import COMPLETION_FIELDS
from serving.http.schemas.sampling import SamplingFields, TokenIds, as_list


def _as_prompts(value: Any) -> Any:
    """A completion prompt is text or token ids; one of either stands for a list of one,
    as in OpenAI's API."""
    if isinstance(value, list) and value and all(_is_int(v) for v in value):
        return [value]
    return as_list(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`: one prompt, or a list of them."""

    field_rules = COMPLETION_FIELDS
    prompt: Annotated[list[str] | list[TokenIds], BeforeValidator(_as_prompts)] = Field(
        min_length=1
    )
    """Each prompt, text or token ids (what evaluation harnesses send), is sampled n
    times; a single one is a list of one."""
    max_tokens: int | None = Field(default=16, ge=1)
    """OpenAI's default for text completions."""
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    """Alternatives per token whose log-probabilities come back (0: the chosen token's)."""
    echo: bool = False
    """Repeat the prompt before the completion, with its tokens' logprobs when asked: what
    evaluation harnesses score log-likelihoods with."""

    @property
    def num_logprobs(self) -> int | None:
        """The `logprobs` count."""
        return self.logprobs

    @property
    def echoed_prompts(self) -> list[str] | list[TokenIds]:
        """Every prompt, with `echo`."""
        return self.prompt if self.echo else []

    @property
    def routing_text(self) -> str:
        """The first prompt when it is text (token ids are routed by their count alone)."""
        first = self.prompt[0]
        return first if isinstance(first, str) else ""
