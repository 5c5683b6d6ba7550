"""A body's sampling fields as the engine's inputs: `SamplingParams`, the output grammar,
and the token ids the fields name checked against the vocabulary.

Each is a 400 naming the field here, at the ingress, so nothing the engine would refuse
reaches a pool (or runs as a batch line).
"""

from __future__ import annotations

from engine.grammar import parse
from engine.sampling_params import GrammarSpec, SamplingParams
from serving.http.errors import bad_request
from serving.http.schemas.sampling import SamplingFields


def sampling_params(body: SamplingFields, max_tokens: int) -> SamplingParams:
    """Map the request's sampling fields onto the engine's, as a 400 when they are invalid."""
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=max(body.top_k, 0),  # -1 is the other common spelling of "off"
            min_tokens=body.min_tokens,
            repetition_penalty=body.repetition_penalty,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            logit_bias=tuple((int(t), bias) for t, bias in (body.logit_bias or {}).items()),
            min_p=body.min_p,
            seed=body.seed,
            stop=tuple(body.stop),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            ignore_eos=body.ignore_eos,
            logprobs=body.num_logprobs,
            prompt_logprobs=body.num_logprobs if body.echoed_prompts else None,
            grammar=output_grammar(body),
        )
    except ValueError as error:
        raise bad_request(str(error)) from None


def output_grammar(body: SamplingFields) -> GrammarSpec | None:
    """The body's output grammar, built and parsed here so that one the library refuses is
    a 400 naming the field that sent it, before any pool sees it (or any batch line runs)."""
    asked = body.grammar_params()
    if not asked:
        return None
    param = asked[0]
    try:
        spec = body.grammar_of(param)
        parse(spec)
    except ValueError as error:
        raise bad_request(f"{param}: {error}", param) from None
    return spec


def check_sampling_token_ids(body: SamplingFields, vocab_size: int) -> None:
    """`logit_bias` keys and `stop_token_ids` must name tokens of the vocabulary."""
    named = {
        "logit_bias": [int(token_id) for token_id in body.logit_bias or {}],
        "stop_token_ids": body.stop_token_ids or [],
    }
    for param, token_ids in named.items():
        if any(token_id >= vocab_size for token_id in token_ids):
            message = f"{param}: token ids must be below the vocabulary size {vocab_size}"
            raise bad_request(message, param)
