"""What of a chat request must match exactly for a stored answer to serve it, and what is
compared by meaning.

Only the last user turn is compared by meaning (embedded). Everything else that changes
the answer must be equal: the model, every sampling setting, the tools and tool choice,
the output format (`response_format`, vLLM's `guided_*`), the system prompt and every
earlier turn. They are hashed together into the entry's key, with the embedding model
and how it embeds a question (serving/cache/question_embedding.py), and entries are only ever
compared within one key, so no setting can leak across: a hit never crosses models,
sampling settings, tools or formats.

Only deterministic requests are cached: greedy (temperature 0), or sampled with an
explicit seed (the seed is part of the key: the same seed and settings give the same
answer, engine/sampler.py). One choice (`n` = 1) and no logprobs: a stored answer has no
log-probabilities to replay.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

from engine.sampling_params import GREEDY_BELOW_TEMPERATURE
from serving.cache.question_embedding import SCHEME
from serving.http.schemas.chat import ChatCompletionRequest, ChatMessage

NOT_IN_KEY = frozenset({"messages", "stream", "stream_options", "user", "tier", "cache"})
"""Body fields that do not change the answer: how it is delivered, who asked, at what tier."""
_SPACE = re.compile(r"\s+")


@dataclass(frozen=True)
class CacheQuery:
    """A cacheable request's two halves: the exact key and the text compared by meaning."""

    key: str
    """Hex digest of the model, settings and conversation before the last user turn."""
    text: str
    """The last user turn, normalized (`normalize`)."""


def cacheable(body: ChatCompletionRequest) -> str | None:
    """Why the request cannot use the cache, or None when it can."""
    if not body.cache:
        return "asked not to"
    if body.temperature >= GREEDY_BELOW_TEMPERATURE and body.seed is None:
        return "not deterministic (temperature > 0 without a seed)"
    if body.n != 1:
        return "n > 1"
    if body.logprobs:
        return "logprobs asked"
    if body.messages[-1].role != "user" or not body.messages[-1].text.strip():
        return "the last turn is not a user question"
    return None


def cache_query(body: ChatCompletionRequest, embedding_model: str) -> CacheQuery:
    """The request's key and compared text (call only when `cacheable` says None)."""
    settings = body.model_dump(mode="json", exclude=set(NOT_IN_KEY))
    earlier = [_turn(m) for m in body.messages[:-1]]
    keyed = {
        "settings": settings, "earlier_turns": earlier, "embedding_model": embedding_model,
        "embedding": SCHEME,
    }  # fmt: skip
    digest = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()
    return CacheQuery(key=digest, text=normalize(body.messages[-1].text))


def normalize(text: str) -> str:
    """Case and runs of white space do not change a question's meaning; both are folded so
    a repeat differing only in them is an exact repeat (the embedding memo's hit)."""
    return _SPACE.sub(" ", text).strip().lower()


def _turn(message: ChatMessage) -> dict[str, object]:
    """An earlier turn exactly as the model sees it."""
    return message.template_turn()
