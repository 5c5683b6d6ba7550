"""Labels for the difficulty router: run the default and the small model on the same
prompts and score each answer, so the router learns where the small one is as good.

Quality of one answer, in [0, 1]:
- a prompt with a checkable answer: 1 if the answer is right, else 0
  (small_model.answer_check);
- an open-ended prompt: the default model's own answer scores 1; the small
  model's scores the teacher's per-token likelihood of it relative to the
  teacher's own answer, exp(mean log p(small answer) - mean log p(own answer)),
  capped at 1: an answer the default model would have given scores near 1.

The label is whether the small model kept the quality: small / default quality,
capped at 1 (1 where both fail a checkable prompt: nothing is lost).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from engine.engine import LLMEngine
from engine.model.chat import chat_prompt_ids
from engine.offline import run_all
from engine.sampling_params import SamplingParams
from policies.difficulty import prompt_features
from small_model.answer_check import answer_matches


@dataclass(frozen=True)
class RoutePrompt:
    """A request to label: its text, what it asked for, and its answer when checkable."""

    text: str
    max_tokens: int
    answer: str | None = None


@dataclass(frozen=True)
class Labelled:
    """Both models' answers to one prompt, their quality, and the router's inputs."""

    prompt: RoutePrompt
    features: dict[str, float]
    default_text: str
    small_text: str
    quality_default: float
    quality_small: float

    @property
    def label(self) -> float:
        """How much of the default model's quality the small model kept (1: all of it)."""
        if self.quality_default <= 0:
            return 1.0
        return min(1.0, self.quality_small / self.quality_default)


def label_prompts(
    prompts: Sequence[RoutePrompt], default: LLMEngine, small: LLMEngine
) -> list[Labelled]:
    """Answer every prompt with both models (greedy) and score the answers."""
    ids = [chat_prompt_ids(default.tokenizer, p.text) for p in prompts]
    limits = [p.max_tokens for p in prompts]
    default_answers = greedy_answers(default, ids, limits)
    small_answers = greedy_answers(small, ids, limits)
    likelihood = _relative_likelihoods(default, prompts, ids, default_answers, small_answers)
    decode = default.tokenizer.decode
    labelled = []
    for i, prompt in enumerate(prompts):
        default_text = decode(default_answers[i], skip_special_tokens=True)
        small_text = decode(small_answers[i], skip_special_tokens=True)
        if prompt.answer is None:
            quality_default, quality_small = 1.0, likelihood[i]
        else:
            quality_default = float(answer_matches(prompt.answer, default_text))
            quality_small = float(answer_matches(prompt.answer, small_text))
        features = prompt_features(prompt.text, len(ids[i]), prompt.max_tokens)
        labelled.append(
            Labelled(prompt, features, default_text, small_text, quality_default, quality_small)
        )
    return labelled


def _relative_likelihoods(
    default: LLMEngine,
    prompts: Sequence[RoutePrompt],
    ids: Sequence[list[int]],
    default_answers: Sequence[list[int]],
    small_answers: Sequence[list[int]],
) -> dict[int, float]:
    """For each open-ended prompt (by index): the default model's likelihood per token of
    the small model's answer relative to its own answer's, capped at 1."""
    indices = [i for i, p in enumerate(prompts) if p.answer is None]
    prompt_ids = [ids[i] for i in indices]
    own = mean_logprobs(default, prompt_ids, [default_answers[i] for i in indices])
    small = mean_logprobs(default, prompt_ids, [small_answers[i] for i in indices])
    return {i: min(1.0, math.exp(s - o)) for i, s, o in zip(indices, small, own, strict=True)}


def greedy_answers(
    engine: LLMEngine, prompts: Sequence[list[int]], max_tokens: Sequence[int]
) -> list[list[int]]:
    """Each prompt's greedy answer, all queued at once (continuous batching)."""
    requests = [
        (prompt, SamplingParams(max_tokens=limit, temperature=0.0))
        for prompt, limit in zip(prompts, max_tokens, strict=True)
    ]
    return [[t for d in deltas for t in d.new_token_ids] for deltas in run_all(engine, requests)]


def mean_logprobs(
    engine: LLMEngine, prompts: Sequence[list[int]], answers: Sequence[list[int]]
) -> list[float]:
    """The engine's mean log-probability per token of each answer after its prompt
    (-inf for an empty answer): scored as an echoed prompt, one step of prefill."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    pairs = list(zip(prompts, answers, strict=True))
    outputs = run_all(engine, [(prompt + answer, params) for prompt, answer in pairs])
    means = []
    for (prompt, answer), deltas in zip(pairs, outputs, strict=True):
        scored = next(d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None)
        values = [entry.logprob for entry in scored[len(prompt) :] if entry is not None]
        means.append(sum(values) / len(values) if answer and values else -math.inf)
    return means
