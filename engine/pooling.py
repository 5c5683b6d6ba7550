"""Embeddings: a prompt pooled into one vector instead of continued with tokens.

An embedding request is a sequence that only prefills: the scheduler gives it
its prompt in chunks like any other, the runner adds each chunk's last-layer
hidden states (after the final norm) to a running sum, and once the whole
prompt is computed the mean of those states, L2-normalized, is its result.
Nothing is sampled and no token is appended; the scheduler then finishes it.

The mean weighs every token alike and does not swing with the text's last token,
which is what an embeddings endpoint's clients expect. The last position's state
(`pooling="last"`) is what the semantic cache reads, over a prompt that frames the
question for it (serving/cache/question_embedding.py). A chunk recomputed after
preemption restarts the sum: the sum is reset whenever a chunk starts at position 0.
"""

from __future__ import annotations

import torch

from engine.request import Request
from engine.sampling_params import PoolingParams

__all__ = ["PooledStates", "PoolingParams"]


class PooledStates:
    """Running sums of each embedding request's hidden states, chunk by chunk."""

    def __init__(self) -> None:
        self._sums: dict[Request, torch.Tensor] = {}

    def add(self, request: Request, start: int, rows: torch.Tensor) -> None:
        """Fold one chunk's hidden states `rows` [n, hidden], computed from prompt position
        `start`, into the request's sum (a chunk at 0 starts it afresh)."""
        params = request.pooling
        assert params is not None, "only embedding requests are pooled"
        if params.pooling == "last":
            self._sums[request] = rows[-1].float()
            return
        chunk = rows.float().sum(dim=0)  # [hidden]
        self._sums[request] = chunk if start == 0 else self._sums[request] + chunk

    def finish(self, request: Request) -> list[float]:
        """The request's embedding once its whole prompt has been added; forgets it."""
        params = request.pooling
        assert params is not None, "only embedding requests are pooled"
        total = self._sums.pop(request)
        vector = total if params.pooling == "last" else total / len(request.prompt_token_ids)
        if params.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return vector.tolist()

    def release(self, request: Request) -> None:
        """Forget a request that ended early (aborted, failed)."""
        self._sums.pop(request, None)
