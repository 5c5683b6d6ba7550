"""What the locust load sends: one request shape per kind of traffic, and each tier's SLO.

Pure Python (no Ray, no torch, no locust), so locust's gevent process imports
it and tests check its distributions in milliseconds. Prompts are assembled
from data/load_corpus.jsonl, text the project wrote for this purpose:
passages of a made-up bike maker's help centre (each with a question it
answers), chat requests and short customer reviews.

Shapes, in tokens (estimated from words: no tokenizer on the client):
- chat: log-normal prompt (median 200) and output (median 128) lengths,
  the long-tailed shape of conversational traces;
- rag: a 1-2k token document of retrieved passages, one of which answers
  the question that follows it; short answers;
- classify: a short review and a one-word label, 1-5 output tokens.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from bench.paths import REPO_ROOT
from bench.prompts import WORDS_PER_TOKEN

DEFAULT_CORPUS = REPO_ROOT / "data" / "load_corpus.jsonl"
MODEL = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class Slo:
    """A tier's latency targets, as the server checks them (policies.tiers.meets_slo)."""

    ttft_ms: float
    tpot_ms: float

    def met_by(self, ttft_ms: float, tpot_ms: float | None) -> bool:
        """Both targets met; `tpot_ms` is None for one output token, where only TTFT applies."""
        return ttft_ms <= self.ttft_ms and (tpot_ms is None or tpot_ms <= self.tpot_ms)


DEFAULT_SLOS = {
    "interactive": Slo(ttft_ms=400, tpot_ms=25),
    "standard": Slo(ttft_ms=2000, tpot_ms=60),
    "batch": Slo(ttft_ms=60000, tpot_ms=500),
}
"""The tiers of configs/local.yaml (a test keeps the two equal)."""


def load_slos(path: Path) -> dict[str, Slo]:
    """Each tier's SLO from a Serve config file (`applications[0].args.tiers`) or a bare
    tierserve config (top-level `tiers`), so the load judges requests as the server does."""
    document: dict[str, Any] = yaml.safe_load(path.read_text())
    args = document["applications"][0]["args"] if "applications" in document else document
    return {t["name"]: Slo(ttft_ms=t["ttft_ms"], tpot_ms=t["tpot_ms"]) for t in args["tiers"]}


@dataclass(frozen=True)
class LogNormal:
    """A log-normal length in tokens, given by its median, clipped to [low, high]."""

    median: float
    sigma: float
    low: int
    high: int

    def sample(self, rng: random.Random) -> int:
        """One length; the clip keeps the long tail inside what the model accepts."""
        value = round(rng.lognormvariate(math.log(self.median), self.sigma))
        return min(self.high, max(self.low, value))


CHAT_PROMPT_TOKENS = LogNormal(median=200, sigma=0.8, low=16, high=1536)
CHAT_OUTPUT_TOKENS = LogNormal(median=128, sigma=0.7, low=8, high=512)
RAG_DOCUMENT_TOKENS = (1000, 2000)
RAG_OUTPUT_TOKENS = LogNormal(median=96, sigma=0.5, low=16, high=384)
CLASSIFY_OUTPUT_TOKENS = (1, 5)
CLASSIFY_INSTRUCTION = (
    "Classify the sentiment of this customer review as positive, negative or neutral. "
    "Answer with one word."
)


class Passage(NamedTuple):
    """A help-centre article and a question it answers."""

    title: str
    text: str
    question: str


@dataclass(frozen=True)
class Corpus:
    """The text prompts are made of (data/load_corpus.jsonl)."""

    passages: tuple[Passage, ...]
    chat_requests: tuple[str, ...]
    reviews: tuple[str, ...]

    @classmethod
    def load(cls, path: Path = DEFAULT_CORPUS) -> Corpus:
        """Read the JSONL corpus: records of kind `passage`, `chat` or `review`."""
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return cls(
            passages=tuple(
                Passage(r["title"], r["text"], r["question"])
                for r in records
                if r["kind"] == "passage"
            ),
            chat_requests=tuple(r["text"] for r in records if r["kind"] == "chat"),
            reviews=tuple(r["text"] for r in records if r["kind"] == "review"),
        )


@dataclass(frozen=True)
class ChatRequest:
    """The body of one streamed chat completion, with what it was sized to."""

    messages: list[dict[str, str]]
    max_tokens: int

    def body(self) -> dict[str, Any]:
        """The OpenAI request body. `ignore_eos` makes the sampled output length the real one
        (as vLLM's serving benchmark does); the usage chunk counts the tokens streamed."""
        return {
            "model": MODEL,
            "messages": self.messages,
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }


def estimate_tokens(text: str) -> int:
    """Tokens of English text, estimated from its word count."""
    return math.ceil(len(text.split()) / WORDS_PER_TOKEN)


def chat_request(corpus: Corpus, rng: random.Random) -> ChatRequest:
    """A chat turn: notes pasted from the help centre, then a request about them."""
    request = rng.choice(corpus.chat_requests)
    num_context_words = int(
        (CHAT_PROMPT_TOKENS.sample(rng) - estimate_tokens(request)) * WORDS_PER_TOKEN
    )
    content = request
    if num_context_words > 0:
        context = _words(corpus, rng, num_context_words)
        content = f"My notes:\n{context}\n\n{request}"
    return ChatRequest([_user(content)], CHAT_OUTPUT_TOKENS.sample(rng))


def rag_request(corpus: Corpus, rng: random.Random) -> ChatRequest:
    """Retrieved passages totalling 1-2k tokens, one of them the answer, then its question."""
    target, *others = rng.sample(corpus.passages, len(corpus.passages))
    budget = rng.randint(*RAG_DOCUMENT_TOKENS)
    retrieved = [target]
    for passage in others:
        if sum(estimate_tokens(p.text) for p in retrieved) >= budget:
            break
        retrieved.append(passage)
    rng.shuffle(retrieved)
    document = "\n\n".join(f"[{i + 1}] {p.title}\n{p.text}" for i, p in enumerate(retrieved))
    content = (
        f"Answer the question using only the documents below.\n\n{document}\n\n"
        f"Question: {target.question}"
    )
    return ChatRequest([_user(content)], RAG_OUTPUT_TOKENS.sample(rng))


def classify_request(corpus: Corpus, rng: random.Random) -> ChatRequest:
    """A review to label: a short prompt and a handful of output tokens."""
    content = f"{CLASSIFY_INSTRUCTION}\n\nReview: {rng.choice(corpus.reviews)}"
    return ChatRequest([_user(content)], rng.randint(*CLASSIFY_OUTPUT_TOKENS))


Workload = Callable[[Corpus, random.Random], ChatRequest]
WORKLOADS: dict[str, Workload] = {
    "chat": chat_request,
    "rag": rag_request,
    "classify": classify_request,
}


def _words(corpus: Corpus, rng: random.Random, num_words: int) -> str:
    """`num_words` words of consecutive passages, starting at a random one."""
    start = rng.randrange(len(corpus.passages))
    words: list[str] = []
    for i in range(len(corpus.passages)):
        words += corpus.passages[(start + i) % len(corpus.passages)].text.split()
        if len(words) >= num_words:
            break
    return " ".join(words[:num_words])


def _user(content: str) -> dict[str, str]:
    return {"role": "user", "content": content}
