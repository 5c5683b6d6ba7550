"""A step's logits into its tokens: one batched draw for the requests without drafts, an
exact verification for each request with drafts (engine/sampler.py draws and verifies).

A draw that raises is retried row by row, so only the request that caused it fails; the
others keep their tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from engine.grammar import GrammarState
from engine.outputs import RunnerOutput, TokenLogprob
from engine.request import Request
from engine.sampler import SampleRow, sample, verify
from engine.spec_decode import Proposal

log = logging.getLogger(__name__)


class StepSampler:
    """Draws each step's tokens under its requests' sampling settings and grammars."""

    def __init__(self) -> None:
        self.grammars: dict[Request, GrammarState] = {}
        """The matcher of each live constrained request (the engine adds and releases)."""

    def sample(
        self,
        requests: list[Request],
        num_logits_rows: list[int],
        logits: torch.Tensor,
        drafts: dict[Request, Proposal],
    ) -> RunnerOutput:
        """Tokens for `requests`, whose logits are `num_logits_rows` rows each of `logits`
        in order: one batched draw for those without drafts, a verification for each with.

        A request whose own sampling raises is reported in `failed`; the others keep
        their tokens.
        """
        first_row = torch.tensor([0, *num_logits_rows[:-1]]).cumsum(0).tolist()
        plain = [i for i, request in enumerate(requests) if request not in drafts]
        plain_logits = (
            logits if len(plain) == len(logits) else logits[[first_row[i] for i in plain]]
        )
        out = RunnerOutput()
        self._sample_plain([requests[i] for i in plain], plain_logits, out)
        for i, request in enumerate(requests):
            if request in drafts:
                own_rows = logits[first_row[i] : first_row[i] + num_logits_rows[i]]
                guarded(request, out, self._verify, request, own_rows, drafts[request], out)
        return out

    def _sample_plain(
        self, requests: list[Request], logits: torch.Tensor, out: RunnerOutput
    ) -> None:
        """Draw all rows at once; if that raises, row by row, so only the culprit fails."""
        if not requests:
            return
        try:
            _record(requests, *sample(logits, [self._sample_row(r) for r in requests]), out)
        except Exception:  # noqa: BLE001 - isolated below, row by row
            for i, request in enumerate(requests):
                guarded(request, out, self._sample_one, request, logits[i : i + 1], out)

    def _sample_one(self, request: Request, logits: torch.Tensor, out: RunnerOutput) -> None:
        _record([request], *sample(logits, [self._sample_row(request)]), out)

    def _verify(
        self, request: Request, logits: torch.Tensor, draft: Proposal, out: RunnerOutput
    ) -> None:
        token_ids, logprobs = verify(logits, self._sample_row(request), draft.token_ids)
        out.sampled_token_ids[request] = token_ids
        if request.params.logprobs is not None:
            out.logprobs[request] = logprobs

    def _sample_row(self, request: Request) -> SampleRow:
        """What the sampler reads of a request; token lists only for a penalty that counts them."""
        params = request.params
        return SampleRow(
            params=params,
            seed=request.sampling_seed,
            seen_token_ids=request.token_ids if params.repetition_penalty != 1.0 else [],
            output_token_ids=request.output_token_ids if params.reads_output else [],
            num_output_tokens=request.num_output_tokens,
            banned_until_min_tokens=(
                tuple(request.eos_token_ids) + params.stop_token_ids if params.min_tokens else ()
            ),
            grammar=self.grammars.get(request),
        )


def _record(
    requests: list[Request],
    token_ids: list[int],
    logprobs: list[TokenLogprob | None],
    out: RunnerOutput,
) -> None:
    """One draw's tokens (and logprobs, when asked) into the step's output."""
    for request, token_id, logprob in zip(requests, token_ids, logprobs, strict=True):
        out.sampled_token_ids[request] = [token_id]
        if logprob is not None:
            out.logprobs[request] = [logprob]


def guarded(request: Request, out: RunnerOutput, work: Callable[..., None], *args: object) -> None:
    """Run one request's share of a step's output, `work(*args)`; an exception fails that
    request alone."""
    try:
        work(*args)
    except Exception as exc:  # noqa: BLE001 - any per-request failure must not stop the batch
        log.exception("sampling failed for request %s", request.request_id)
        out.failed[request] = f"sampling failed: {exc!r}"
        out.sampled_token_ids.pop(request, None)
