"""Turn logits into tokens: biases and penalties, temperature, top-k / top-p / min-p,
seeded draws.

A draw is the exponential race: the token maximising p(x) / E(x), with E
Exp(1) noise generated from the request's seed and the output position alone.
That is an exact draw from p, and it makes each token a function of the
logits, the seed and the position: the same whatever else shares the batch,
and whether or not speculation guessed it (verification keeps a draft exactly
when it is the token the target draws there). With batch-invariant logits
(engine.model.batch_invariance) a seeded request therefore returns the same
text every time. `probs_for` exposes the processed distribution so a draft
model draws from the very same temperature / top-k / top-p / min-p.

The order is vLLM's and transformers': logit biases, the repetition penalty,
presence and frequency penalties, the min_tokens ban (all on the raw logits);
then temperature, top-k, top-p and min-p. The penalties read the output so
far, so verification counts the drafts accepted before each position as
output: every position is sampled exactly as it would be without drafts.

A request with a grammar (engine/grammar.py) has its row masked to the tokens
the grammar allows before all of that; its matcher advances by each emitted
token, so in verification every position is masked by the state after the
drafts accepted before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from engine.grammar import GrammarState, mask_logits
from engine.kernels.argmax import argmax_rows
from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams

NOISE_FLOOR = 1e-30
"""Exp(1) noise is clamped above zero: a 0 / 0 would be NaN, which argmax prefers."""


@dataclass(frozen=True)
class SampleRow:
    """What the sampler needs to know about one row of logits."""

    params: SamplingParams
    seed: int
    """The request's sampling seed (its own, or one the engine drew for it)."""
    seen_token_ids: Sequence[int]
    """Prompt and output so far: for the repetition penalty (empty when it is off)."""
    num_output_tokens: int
    """Tokens produced so far: the next one's position, which keys its random draw."""
    banned_until_min_tokens: tuple[int, ...]
    """EOS and stop token ids, masked while fewer than min_tokens were produced."""
    output_token_ids: Sequence[int] = ()
    """Output so far: for the presence and frequency penalties (empty when they are off)."""
    grammar: GrammarState | None = None
    """The request's matcher when its output is constrained; advanced as tokens are drawn."""

    def after(self, accepted: Sequence[int]) -> SampleRow:
        """The row at the position after `accepted` drafts, which count as output there."""
        if not accepted:
            return self
        return replace(
            self,
            seen_token_ids=[*self.seen_token_ids, *accepted],
            output_token_ids=[*self.output_token_ids, *accepted],
            num_output_tokens=self.num_output_tokens + len(accepted),
        )


def sample(
    logits: torch.Tensor, rows: list[SampleRow]
) -> tuple[list[int], list[TokenLogprob | None]]:
    """One token per row of `logits` [N, V], and its log-probability under the raw model for
    the rows whose request asked for logprobs (None for the others: no softmax is spent).
    Constrained rows draw among the tokens their grammar allows, which then advances."""
    masked = mask_logits(logits, [row.grammar for row in rows])
    argmax = argmax_rows(masked)  # one batched call serves every plain greedy row
    token_ids = [
        argmax[i] if _is_plain_greedy(row) else sample_row(masked[i], row)
        for i, row in enumerate(rows)
    ]
    for row, token in zip(rows, token_ids, strict=True):
        if row.grammar is not None:  # after every draw: a failed batch advances no matcher
            row.grammar.accept(token)
    logprobs = [
        None
        if row.params.logprobs is None
        else token_logprobs(logits[i : i + 1], [token], row.params.logprobs)[0]
        for i, (row, token) in enumerate(zip(rows, token_ids, strict=True))
    ]
    return token_ids, logprobs


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprob]:
    """Of token_ids[i] under row i of `logits` [N, V] (the raw model's distribution), with
    the likeliest `num_top` alternatives at each position."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs[torch.arange(len(token_ids)), torch.tensor(token_ids, dtype=torch.long)]
    top_values, top_ids = logprobs.topk(num_top, dim=-1)
    return [
        TokenLogprob(logprob, tuple(zip(ids, values, strict=True)))
        for logprob, ids, values in zip(
            chosen.tolist(), top_ids.tolist(), top_values.tolist(), strict=True
        )
    ]


def _is_plain_greedy(row: SampleRow) -> bool:
    """Greedy with no logit adjustment due: the batched argmax is its answer."""
    params = row.params
    banned = row.num_output_tokens < params.min_tokens and row.banned_until_min_tokens
    return params.greedy and not params.adjusts_logits and not banned


def sample_row(logits: torch.Tensor, row: SampleRow) -> int:
    """The row's token at its position: the argmax when greedy, else the seeded draw."""
    logits = adjust_logits(logits, row)
    if row.params.greedy:
        return int(logits.argmax())
    return draw(probs_for(logits, row.params), row.seed, row.num_output_tokens)


def draw(probs: torch.Tensor, seed: int, position: int) -> int:
    """A draw from `probs` fixed by (seed, position): the exponential race."""
    noise = torch.empty(probs.shape[-1]).exponential_(generator=_position_generator(seed, position))
    return int((probs / noise.clamp_min_(NOISE_FLOOR)).argmax())


def _position_generator(seed: int, position: int) -> torch.Generator:
    """A generator for one output position of one seed (splitmix64 of the pair, so
    neighbouring positions and seeds get unrelated streams)."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) % 2**64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 % 2**64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB % 2**64
    return torch.Generator().manual_seed(z ^ (z >> 31))


def adjust_logits(logits: torch.Tensor, row: SampleRow) -> torch.Tensor:
    """Apply the biases, the penalties and the min_tokens ban (before any sampling choice)."""
    params = row.params
    if params.logit_bias:
        logits = apply_logit_bias(logits, params.logit_bias)
    if params.repetition_penalty != 1.0 and row.seen_token_ids:
        logits = apply_repetition_penalty(logits, row.seen_token_ids, params.repetition_penalty)
    if params.reads_output and row.output_token_ids:
        logits = apply_presence_frequency_penalties(
            logits, row.output_token_ids, params.presence_penalty, params.frequency_penalty
        )
    if row.num_output_tokens < params.min_tokens and row.banned_until_min_tokens:
        logits = logits.clone()
        logits[list(row.banned_until_min_tokens)] = float("-inf")
    return logits


def apply_logit_bias(logits: torch.Tensor, bias: Sequence[tuple[int, float]]) -> torch.Tensor:
    """OpenAI's logit_bias: each listed token's logit plus its bias."""
    token_ids, values = zip(*bias, strict=True)
    logits = logits.clone()
    logits[list(token_ids)] += torch.tensor(values, dtype=logits.dtype)
    return logits


def apply_repetition_penalty(
    logits: torch.Tensor, seen: Sequence[int], penalty: float
) -> torch.Tensor:
    """CTRL's penalty as HF applies it: positive logits of seen tokens shrink, negative grow."""
    index = torch.tensor(sorted(set(seen)), dtype=torch.long)
    picked = logits[index]
    logits = logits.clone()
    logits[index] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def apply_presence_frequency_penalties(
    logits: torch.Tensor, output_token_ids: Sequence[int], presence: float, frequency: float
) -> torch.Tensor:
    """OpenAI's additive rule over the output so far: a token the output holds c > 0 times
    loses c x frequency + presence from its logit (the prompt does not count)."""
    token_ids, counts = torch.tensor(output_token_ids, dtype=torch.long).unique(return_counts=True)
    logits = logits.clone()
    logits[token_ids] -= counts.to(logits.dtype) * frequency + presence
    return logits


def probs_for(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy request samples from: temperature, then top-k, top-p
    and min-p."""
    scaled = logits / params.temperature
    masked = mask_top_k_top_p(scaled, params.top_k, params.top_p)
    return torch.softmax(mask_min_p(masked, params.min_p), dim=-1)


def mask_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Set to -inf every logit whose probability is below min_p x the largest (the largest
    always survives), as transformers' MinPLogitsWarper does."""
    if min_p <= 0.0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


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
) -> tuple[list[int], list[TokenLogprob]]:
    """Speculative verification: accepted drafts, then one correction or bonus token.

    At each position the target's own token is drawn (`sample_row`: the argmax,
    or the seeded exponential race, with the drafts accepted before it counted
    as output by the penalties, and the grammar's mask after them); a draft
    survives while it equals that token, so one the grammar forbids never does.
    The matcher advances by the emitted tokens alone and stops at the grammar's
    end: it holds exactly what was accepted.
    Every emitted token is thus exactly what sampling without drafts would
    have produced at its position, so the output distribution is the
    target's and a seeded request's text does not depend on the drafts. A
    draft model that races with the same noise (spec_decode) is accepted as
    often as its distribution agrees with the target's. When every draft
    survives, the last row gives a bonus token. Logprobs of the emitted tokens
    come back only when the request asked for them (else []).
    """
    tokens: list[int] = []
    grammar = row.grammar
    for i, logits_row in enumerate(logits[: len(draft_token_ids) + 1]):
        masked = mask_logits(logits_row[None], [grammar])[0]
        token = sample_row(masked, row.after(draft_token_ids[:i]))
        tokens.append(token)
        if grammar is not None:
            grammar.accept(token)
        if i == len(draft_token_ids) or token != draft_token_ids[i]:
            break
        if grammar is not None and grammar.is_terminated:
            break
    if row.params.logprobs is None:
        return tokens, []
    return tokens, token_logprobs(logits[: len(tokens)], tokens, row.params.logprobs)
