"""Engine log-probabilities in OpenAI's two shapes: chat's entries and completions' lists.

The engine reports token ids; a token's text is what the tokenizer decodes of
it alone (a piece of a multi-byte character decodes to U+FFFD, as in vLLM),
with its UTF-8 bytes beside it in chat's shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.outputs import TokenLogprob
from serving.http.schemas.responses import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
)


def chat_logprobs(
    tokenizer: Any, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob]
) -> ChatLogprobs:
    """Chat's `logprobs`: each token's text, log-probability, bytes and alternatives."""
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                **_entry(tokenizer, token_id, lp.logprob),
                top_logprobs=[TopLogprob(**_entry(tokenizer, t, v)) for t, v in lp.top],
            )
            for token_id, lp in zip(token_ids, logprobs, strict=True)
        ]
    )


def completion_logprobs(
    tokenizer: Any,
    token_ids: Sequence[int],
    logprobs: Sequence[TokenLogprob | None],
    text_offset: int,
) -> CompletionLogprobs:
    """Completions' `logprobs`: parallel lists; a token with no log-probability (an echoed
    prompt's first) has None. Offsets count from `text_offset`."""
    tokens = [tokenizer.decode([token_id]) for token_id in token_ids]
    offsets = [text_offset + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[None if lp is None else lp.logprob for lp in logprobs],
        top_logprobs=[
            None if lp is None else {tokenizer.decode([t]): v for t, v in lp.top} for lp in logprobs
        ],
        text_offset=offsets,
    )


def _entry(tokenizer: Any, token_id: int, logprob: float) -> dict[str, Any]:
    text = tokenizer.decode([token_id])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
