"""The configured bounds on what one request may ask for (RequestLimits), checked after
the body is parsed: prompts, sequences (n x prompts) and stop strings."""

from __future__ import annotations

from serving.config import RequestLimits
from serving.http.errors import bad_request
from serving.http.schemas.completion import CompletionRequest
from serving.http.schemas.sampling import SamplingFields


def num_prompts(body: SamplingFields) -> int:
    """Prompts in the request: a chat is one conversation."""
    return len(body.prompt) if isinstance(body, CompletionRequest) else 1


def check_limits(body: SamplingFields, limits: RequestLimits) -> None:
    """Refuse with a 400 naming the field a request over any configured bound."""
    prompts = num_prompts(body)
    if prompts > limits.max_prompts:
        raise bad_request(
            f"prompt has {prompts} prompts; at most {limits.max_prompts} per request.", "prompt"
        )
    if prompts * body.n > limits.max_sequences:
        raise bad_request(
            f"n ({body.n}) x prompts ({prompts}) is {prompts * body.n} sequences; "
            f"at most {limits.max_sequences} per request.",
            "n",
        )
    if len(body.stop) > limits.max_stop_strings:
        raise bad_request(
            f"stop has {len(body.stop)} strings; at most {limits.max_stop_strings}.", "stop"
        )
    if any(len(s) > limits.max_stop_chars for s in body.stop):
        raise bad_request(
            f"each stop string may be at most {limits.max_stop_chars} characters.", "stop"
        )
    if any(not s for s in body.stop):
        raise bad_request("stop strings must not be empty.", "stop")
