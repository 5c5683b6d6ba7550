"""Synthetic chat prompts for the load tools: deterministic, offline, any length.

Pure Python (no torch, no Ray), so locust's gevent process can import it too.
Words are drawn from everyday English so the tokenizer sees ordinary text,
about 1.3 tokens per word for the default model.
"""

from __future__ import annotations

import random

_VOCABULARY = (
    "the a of to and in is that for it as with was on be by this are from at or have an "
    "they which one you had not but what all were when we there can been has more if will "
    "would about how up out them then she many some so these time could make like into "
    "him has two see more write go number way people my than first water been call who "
    "its now find long down day did get come made may part over new sound take only little "
    "work know place year live back give most very after thing our just name good sentence "
    "man think say great where help through much before line right too mean old any same "
    "tell boy follow came want show also around form three small set put end does another "
    "well large must big even such because turn here why ask went men read need land "
    "different home us move try kind hand picture again change off play spell air away "
    "animal house point page letter mother answer found study still learn should world"
)
_WORDS = _VOCABULARY.split()

QUESTIONS = (
    "Summarize the text above in two sentences.",
    "What is the main point of the passage above?",
    "Rewrite the passage above as a short list of facts.",
    "Explain the text above to a child.",
)
WORDS_PER_TOKEN = 0.75
"""Rough English words per token of the default tokenizer; for sizing without a tokenizer."""


def passage(num_words: int, rng: random.Random) -> str:
    """`num_words` words of filler text, broken into sentences."""
    words = [rng.choice(_WORDS) for _ in range(num_words)]
    sentences = [" ".join(words[i : i + 12]).capitalize() + "." for i in range(0, num_words, 12)]
    return " ".join(sentences)


def chat_turn(num_tokens: int, rng: random.Random) -> str:
    """A user message of about `num_tokens` tokens: a passage, then a question about it."""
    num_words = max(1, int(num_tokens * WORDS_PER_TOKEN))
    return f"{passage(num_words, rng)}\n\n{rng.choice(QUESTIONS)}"
