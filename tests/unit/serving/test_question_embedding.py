"""The semantic cache's way of embedding a question, on the real model and the project's
held-out pairs: framed as a question with its last state, paraphrases score above near
misses; the plain text's mean, which /v1/embeddings serves, ranks them the other way."""

from __future__ import annotations

from cli.cache import embed_texts
from serving.cache.calibration import load_pairs, separation_auc, similarities
from serving.cache.question_embedding import PROMPT, SCHEME, question_prompt
from serving.cache.request_key import cache_query
from serving.http.schemas.chat import ChatCompletionRequest


def test_the_framed_question_separates_paraphrases_from_near_misses(engine) -> None:
    pairs = [p for p in load_pairs() if p.split == "held_out"]
    texts = [t for p in pairs for t in (p.a, p.b)]

    def held_out_auc(framed: bool, pooling: str) -> float:
        vectors = embed_texts(engine, texts, framed, pooling)
        return separation_auc(
            similarities(pairs, vectors, "paraphrase", "held_out"),
            similarities(pairs, vectors, "near_miss", "held_out"),
        )

    assert held_out_auc(framed=True, pooling="last") > 0.75
    assert held_out_auc(framed=False, pooling="mean") < 0.5


def test_entries_embedded_another_way_are_under_another_key(monkeypatch) -> None:
    """A store kept across an upgrade (Redis) never compares vectors made two ways."""
    assert question_prompt("what is 2+2?") == PROMPT.format("what is 2+2?")
    assert PROMPT in SCHEME
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "Hi?"}]}
    )
    key = cache_query(body, "model").key
    monkeypatch.setattr("serving.cache.request_key.SCHEME", "mean:{}")
    assert cache_query(body, "model").key != key
