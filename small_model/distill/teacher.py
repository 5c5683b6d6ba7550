"""The teacher's answers and soft targets: what the student learns from.

The serving engine generates them (batched, paged, at serving speed), asking
for the top-k log-probabilities of every answer token. Those k are the soft
targets: with them the student needs no teacher forward pass while it trains,
which on a CPU would cost as much again as the student's own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.engine import LLMEngine
from engine.offline import run_all
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class Example:
    """One prompt with the teacher's greedy answer and, per answer token, its top-k."""

    prompt_ids: list[int]
    answer_ids: list[int]
    top_ids: list[list[int]]
    """For each answer token, the teacher's k likeliest next tokens at that position."""
    top_logprobs: list[list[float]]


def teacher_examples(
    engine: LLMEngine,
    prompts: Sequence[list[int]],
    max_tokens: int,
    top_k: int,
    on_finish: Callable[[], None] = lambda: None,
) -> list[Example]:
    """The teacher's greedy answer to every prompt, with its top-k at each answer token.

    All prompts are queued at once: the engine's continuous batching keeps its
    batch full. `on_finish` is called once per finished answer (a progress bar).
    """
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=top_k)
    answers = run_all(engine, [(list(prompt), params) for prompt in prompts], on_finish)
    return [_example(prompt, deltas) for prompt, deltas in zip(prompts, answers, strict=True)]


def _example(prompt: list[int], deltas: list[RequestOutput]) -> Example:
    """Join one request's deltas into an Example."""
    answer = [token for delta in deltas for token in delta.new_token_ids]
    scores = [score for delta in deltas for score in delta.new_logprobs or []]
    if deltas and deltas[-1].finish_reason == "error":
        raise RuntimeError(f"the teacher failed on a prompt: {deltas[-1].error}")
    return Example(
        prompt_ids=list(prompt),
        answer_ids=answer,
        top_ids=[[token for token, _ in s.top] for s in scores],
        top_logprobs=[[value for _, value in s.top] for s in scores],
    )
