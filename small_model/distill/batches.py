"""Examples packed into padded training batches, sorted by length so little is padding."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from small_model.distill.teacher import Example


@dataclass(frozen=True)
class Batch:
    """Right-padded token ids and, for every answer token, where it is predicted from."""

    input_ids: torch.Tensor
    """[B, L] prompt then answer (its last token dropped: nothing is learned after it)."""
    attention_mask: torch.Tensor
    rows: torch.Tensor
    """[N] batch row of each answer token."""
    cols: torch.Tensor
    """[N] position whose output predicts that answer token."""
    top_ids: torch.Tensor
    """[N, k] the teacher's k likeliest tokens there."""
    top_logprobs: torch.Tensor
    """[N, k] and their log-probabilities."""

    @property
    def num_tokens(self) -> int:
        """Tokens run through the student (padding excluded)."""
        return int(self.attention_mask.sum())


def make_batches(examples: Sequence[Example], max_tokens: int, pad_id: int) -> list[Batch]:
    """Length-sorted examples grouped so each batch's padded size stays under `max_tokens`."""
    ordered = sorted((e for e in examples if e.answer_ids), key=_length)
    groups: list[list[Example]] = []
    for example in ordered:
        # Sorted ascending: the newest member is the longest, so it sets the padded width.
        if groups and (len(groups[-1]) + 1) * _length(example) <= max_tokens:
            groups[-1].append(example)
        else:
            groups.append([example])
    return [_batch(group, pad_id) for group in groups]


def epoch_order(num_batches: int, epoch: int, seed: int) -> list[int]:
    """The batches' order in one epoch: shuffled, the same for the same (epoch, seed), so a
    resumed run sees the batches it would have seen."""
    order = list(range(num_batches))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def _length(example: Example) -> int:
    return len(example.prompt_ids) + len(example.answer_ids) - 1


def _batch(group: list[Example], pad_id: int) -> Batch:
    width = max(_length(e) for e in group)
    input_ids = torch.full((len(group), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(group), width), dtype=torch.long)
    rows, cols = [], []
    for row, example in enumerate(group):
        tokens = (example.prompt_ids + example.answer_ids)[:-1]
        input_ids[row, : len(tokens)] = torch.tensor(tokens)
        mask[row, : len(tokens)] = 1
        first = len(example.prompt_ids) - 1  # the prompt's last position predicts answer[0]
        rows += [row] * len(example.answer_ids)
        cols += range(first, first + len(example.answer_ids))
    return Batch(
        input_ids=input_ids,
        attention_mask=mask,
        rows=torch.tensor(rows),
        cols=torch.tensor(cols),
        top_ids=torch.tensor([ids for e in group for ids in e.top_ids]),
        top_logprobs=torch.tensor([lp for e in group for lp in e.top_logprobs]),
    )
