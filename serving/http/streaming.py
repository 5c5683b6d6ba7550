"""Per-choice progress and the merging of several choices' token streams into one."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from engine.outputs import FirstTokenTimes, RequestOutput, TokenLogprob
from serving.http.schemas.responses import Usage

T = TypeVar("T")


@dataclass
class SequenceProgress:
    """What one choice has produced and when: feeds the response, usage and latency metrics."""

    start_s: float
    """Monotonic time the request reached the ingress."""
    prompt_index: int
    """Which of the request's prompts this choice samples from."""
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    """One per token, when the request asked for logprobs."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """One per prompt token, when the request asked for them (an echo with logprobs)."""
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    first_token_s: float | None = None
    last_token_s: float | None = None
    inter_token_s: list[float] = field(default_factory=list)
    queue_time_s: float | None = None
    """Engine-side wait before first scheduled, from the first output that reports it."""
    first_token_times: FirstTokenTimes | None = None
    """The engine's and its front's instants on the way to the first token."""
    finish_reason: str | None = None

    def add(self, output: RequestOutput, now_s: float) -> None:
        """Fold one engine delta in, timing it at `now_s`."""
        num_new = len(output.new_token_ids)
        if num_new and self.last_token_s is not None:
            # A delta may carry several tokens (speculative decoding): spread the gap over them.
            self.inter_token_s += [(now_s - self.last_token_s) / num_new] * num_new
        if num_new:
            self.first_token_s = self.first_token_s or now_s
            self.last_token_s = now_s
        self.text_parts.append(output.new_text)
        self.token_ids += output.new_token_ids
        self.logprobs += output.new_logprobs or []
        self.prompt_logprobs = self.prompt_logprobs or output.prompt_logprobs
        self.num_prompt_tokens = output.num_prompt_tokens or self.num_prompt_tokens
        self.num_output_tokens += num_new
        if self.queue_time_s is None:
            self.queue_time_s = output.queue_time_s
        self.first_token_times = self.first_token_times or output.first_token_times
        self.finish_reason = output.finish_reason

    @property
    def text(self) -> str:
        """Everything generated so far."""
        return "".join(self.text_parts)

    @property
    def ttft_s(self) -> float | None:
        """Time to first token, from arrival at the ingress; None before it."""
        return None if self.first_token_s is None else self.first_token_s - self.start_s

    def ttft_hops_s(self) -> dict[str, float] | None:
        """Where the time to first token went, hop by hop (None without the engine's times):
        the Serve handle to the pool replica, its loop's inbox (a running step holds it),
        the engine queue, the steps to the first token, and the two ways back."""
        times = self.first_token_times
        if times is None or times.sent_s is None or times.received_s is None:
            return None
        if self.first_token_s is None:
            return None
        to_wall = time.time() - time.monotonic()
        return {
            "to_pool": times.sent_s - (self.start_s + to_wall),
            "to_engine": times.arrived_s - times.sent_s,
            "engine_queue": times.scheduled_s - times.arrived_s,
            "to_first_token": times.first_token_s - times.scheduled_s,
            "to_pool_back": times.received_s - times.first_token_s,
            "to_ingress_back": (self.first_token_s + to_wall) - times.received_s,
        }

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        if self.num_output_tokens < 2 or self.first_token_s is None or self.last_token_s is None:
            return None
        return (self.last_token_s - self.first_token_s) / (self.num_output_tokens - 1)


def usage(choices: list[SequenceProgress]) -> Usage:
    """Token counts of a request; a prompt sampled n times is counted once, as OpenAI does."""
    prompt_tokens = sum({c.prompt_index: c.num_prompt_tokens for c in choices}.values())
    completion_tokens = sum(c.num_output_tokens for c in choices)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


_DONE = object()


async def merge_streams(
    streams: Sequence[AsyncIterator[T]], deadline_s: float | None = None
) -> AsyncIterator[tuple[int, T]]:
    """Items of all streams as they arrive, tagged with their stream's index.

    An error in any stream is raised here; so is TimeoutError once the loop
    clock passes `deadline_s`. Leaving early, either way, cancels every pump.
    """
    queue: asyncio.Queue[tuple[int, object, BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item, None))
            await queue.put((index, _DONE, None))
        except Exception as error:  # handed to the consumer, which decides
            await queue.put((index, _DONE, error))

    loop = asyncio.get_running_loop()
    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        num_open = len(tasks)
        while num_open:
            # Timed per wait, not around the loop: a timeout scope spanning `yield`
            # would cancel the consumer wherever it happens to be.
            timeout_s = None if deadline_s is None else deadline_s - loop.time()
            index, item, error = await asyncio.wait_for(queue.get(), timeout_s)
            if error is not None:
                raise error
            if item is _DONE:
                num_open -= 1
                continue
            yield index, item  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
