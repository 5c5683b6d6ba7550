"""A live request's output side: its text so far, stop strings, prompt scores, and the
`RequestOutput` deltas the engine emits for it.

The scheduler owns what a request computes; this owns what its client reads, so the
engine's step stays glue between the two.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from engine.detokenizer import IncrementalDetokenizer, StopStringFilter
from engine.outputs import FirstTokenTimes, RequestOutput, TokenLogprob
from engine.request import Request


@dataclass
class LiveSequence:
    """A live request with its output-side state: text so far and stop strings."""

    request: Request
    detokenizer: IncrementalDetokenizer
    stop_filter: StopStringFilter
    prompt_logprobs: dict[int, TokenLogprob] = field(default_factory=dict)
    """Scores of prompt tokens by index, gathered over the prompt's chunks (a chunk
    recomputed after preemption overwrites its own)."""

    @classmethod
    def start(cls, request: Request, tokenizer: PreTrainedTokenizerBase) -> LiveSequence:
        """A request's output side before its first token."""
        params = request.params
        return cls(
            request,
            IncrementalDetokenizer(tokenizer, request.prompt_token_ids, params.skip_special_tokens),
            StopStringFilter(params.stop, params.include_stop_str_in_output),
        )

    def push(self, token_ids: list[int]) -> tuple[str, bool]:
        """The text the kept tokens add, up to any stop string; and whether one was hit.

        A stop token's text is kept only when asked (vLLM's rule).
        """
        request = self.request
        reason = request.finish_reason
        drop_stop_token = reason == "stop" and not request.params.include_stop_str_in_output
        text = self.detokenizer.push(token_ids[:-1] if drop_stop_token else token_ids)
        return self.stop_filter.push(text, final=reason is not None)

    def output(
        self,
        token_ids: list[int],
        logprobs: list[TokenLogprob] | None,
        text: str,
        reason: str | None,
        embedding: list[float] | None = None,
        error: str | None = None,
    ) -> RequestOutput:
        """The delta a step (or an abort or failure) gives the request's stream; an embedding
        request's last carries its embedding."""
        request = self.request
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=token_ids,
            new_text=text,
            finished=reason is not None,
            finish_reason=reason,
            new_logprobs=logprobs,
            prompt_logprobs=self._prompt_scores(token_ids),
            num_prompt_tokens=len(request.prompt_token_ids),
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
            queue_time_s=request.queue_time_s,
            first_token_times=_first_token_times(request, token_ids),
            embedding=embedding,
            error=error,
        )

    def _prompt_scores(self, token_ids: list[int]) -> list[TokenLogprob | None] | None:
        """The prompt's scores, in the request's first output with tokens (else None)."""
        request = self.request
        if request.params.prompt_logprobs is None or not _is_first(request, token_ids):
            return None
        scores = self.prompt_logprobs
        return [None, *(scores[i] for i in range(1, len(request.prompt_token_ids)))]


def _is_first(request: Request, token_ids: list[int]) -> bool:
    """This delta holds the request's first output token."""
    return bool(token_ids) and len(token_ids) == request.num_output_tokens


def _first_token_times(request: Request, token_ids: list[int]) -> FirstTokenTimes | None:
    """On the delta with the first token: the request's monotonic arrival and scheduling as
    wall-clock instants, now being its first token's (the front fills in its own two)."""
    if not _is_first(request, token_ids):
        return None
    now_s, wall_s = time.monotonic(), time.time()
    scheduled_s = request.first_scheduled_time_s or now_s
    return FirstTokenTimes(
        sent_s=None,
        arrived_s=wall_s - (now_s - request.arrival_time_s),
        scheduled_s=wall_s - (now_s - scheduled_s),
        first_token_s=wall_s,
    )
