"""Reference logits processors the sampler is checked against, written as transformers'
`LogitsProcessor`s so they run inside `generate` too."""

from __future__ import annotations

import torch
from transformers import LogitsProcessor


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's documented rule, written out token by token: the reference."""

    def __init__(self, num_prompt: int, presence: float, frequency: float) -> None:
        self.num_prompt, self.presence, self.frequency = num_prompt, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        for b, ids in enumerate(input_ids.tolist()):
            output = ids[self.num_prompt :]
            for token in set(output):
                count = output.count(token)
                scores[b, token] -= count * self.frequency + (count > 0) * self.presence
        return scores
