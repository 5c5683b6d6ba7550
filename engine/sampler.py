"""Turn logits into tokens: penalties, temperature, top-k / top-p, seeded draws.

Every row draws with its own `torch.Generator`, so a request with a seed
gets the same tokens whatever else shares the batch. `probs_for` exposes the
processed distribution so speculative verification applies the very same
temperature / top-k / top-p to target and draft.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class SampleRow:
    """What the sampler needs to know about one row of logits."""

    params: SamplingParams
    generator: torch.Generator
    seen_token_ids: list[int]
    """Prompt and output so far: for the repetition penalty."""
    num_output_tokens: int
    banned_until_min_tokens: tuple[int, ...]
    """EOS and stop token ids, masked while fewer than min_tokens were produced."""


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> tuple[list[int], list[float | None]]:
    """One token per row of `logits` [N, V], and its log-probability under the raw model for
    the rows whose request asked for logprobs (None for the others: no softmax is spent)."""
    argmax = logits.argmax(dim=-1).tolist()  # one batched call serves every plain greedy row
    token_ids = [
        argmax[i] if _is_plain_greedy(row) else _sample_row(logits[i], row)
        for i, row in enumerate(rows)
    ]
    logprobs = [
        token_logprobs(logits[i : i + 1], [token])[0] if row.params.logprobs else None
        for i, (row, token) in enumerate(zip(rows, token_ids, strict=True))
    ]
    return token_ids, logprobs


def token_logprobs(logits: torch.Tensor, token_ids: list[int]) -> list[float]:
    """log p(token_ids[i]) under row i of `logits` [N, V]: the raw model's distribution."""
    chosen = logits[torch.arange(len(token_ids)), torch.tensor(token_ids, dtype=torch.long)]
    return (chosen - torch.logsumexp(logits, dim=-1)).tolist()


def _is_plain_greedy(row: SampleRow) -> bool:
    """Greedy with no logit adjustment due: the batched argmax is its answer."""
    params = row.params
    banned = row.num_output_tokens < params.min_tokens and row.banned_until_min_tokens
    return params.greedy and params.repetition_penalty == 1.0 and not banned


def _sample_row(logits: torch.Tensor, row: SampleRow) -> int:
    logits = adjust_logits(logits, row)
    if row.params.greedy:
        return int(logits.argmax())
    probs = probs_for(logits, row.params)
    return int(torch.multinomial(probs, 1, generator=row.generator))


def adjust_logits(logits: torch.Tensor, row: SampleRow) -> torch.Tensor:
    """Apply the repetition penalty and the min_tokens ban (before any sampling choice)."""
    params = row.params
    if params.repetition_penalty != 1.0 and row.seen_token_ids:
        logits = apply_repetition_penalty(logits, row.seen_token_ids, params.repetition_penalty)
    if row.num_output_tokens < params.min_tokens and row.banned_until_min_tokens:
        logits = logits.clone()
        logits[list(row.banned_until_min_tokens)] = float("-inf")
    return logits


def apply_repetition_penalty(logits: torch.Tensor, seen: list[int], penalty: float) -> torch.Tensor:
    """CTRL's penalty as HF applies it: positive logits of seen tokens shrink, negative grow."""
    index = torch.tensor(sorted(set(seen)), dtype=torch.long)
    picked = logits[index]
    logits = logits.clone()
    logits[index] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def probs_for(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy request samples from: temperature, then top-k, then top-p."""
    scaled = logits / params.temperature
    return torch.softmax(mask_top_k_top_p(scaled, params.top_k, params.top_p), dim=-1)


def mask_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set to -inf every logit outside the top k and outside the smallest set holding top_p mass."""
    top_k = max(top_k, 0)  # -1 and 0 both mean off
    if top_k == 0 and top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(descending=True)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if 0 < top_k < logits.shape[-1]:
        drop[top_k:] = True
    if top_p < 1.0:
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= mass_before >= top_p  # the top token always survives: mass_before is 0
    unsorted_drop = torch.empty_like(drop).scatter_(0, order, drop)
    return logits.masked_fill(unsorted_drop, float("-inf"))


def verify(
    logits: torch.Tensor,  # [k + 1, V] target logits at the last real token and each draft
    row: SampleRow,
    draft_token_ids: list[int],
    draft_probs: torch.Tensor | None,  # [k, V], None for a deterministic (one-hot) draft
) -> tuple[list[int], list[float]]:
    """Speculative verification: accepted drafts, then one correction or bonus token.

    Greedy: a draft survives while it equals the target's argmax. Sampling uses
    the modified rejection rule, which leaves the output distributed exactly as
    the target's p: accept draft x with probability min(1, p(x) / q(x)); on
    rejection draw from the residual max(0, p - q) / Z. A one-hot q (prompt
    lookup) makes that: accept x with probability p(x), else draw from p with x
    removed. When every draft survives, the last row gives a bonus token. Logprobs of
    the emitted tokens come back only when the request asked for them (else []).
    """
    tokens: list[int] = []
    for i, draft in enumerate(draft_token_ids):
        q = None if draft_probs is None else draft_probs[i]
        token, accepted = _verify_one(logits[i], row, draft, q)
        tokens.append(token)
        if not accepted:
            break
    else:
        tokens.append(_sample_row(logits[len(draft_token_ids)], row))
    if not row.params.logprobs:
        return tokens, []
    return tokens, token_logprobs(logits[: len(tokens)], tokens)


def _verify_one(
    logits: torch.Tensor, row: SampleRow, draft: int, q: torch.Tensor | None
) -> tuple[int, bool]:
    """(token to emit at this position, whether it was the draft)."""
    if row.params.greedy:
        target = int(logits.argmax())
        return target, target == draft
    p = probs_for(logits, row.params)
    q_draft = 1.0 if q is None else float(q[draft])
    u = float(torch.rand((), generator=row.generator))
    if u * q_draft < float(p[draft]):  # u < p(x) / q(x), without dividing by zero
        return draft, True
    if q is None:
        q = torch.zeros_like(p)
        q[draft] = 1.0
    residual = (p - q).clamp_min(0)
    if float(residual.sum()) <= 0:  # p == q: the rejection had probability 0
        residual = p
    return int(torch.multinomial(residual, 1, generator=row.generator)), False
