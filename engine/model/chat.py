"""The chat template in one place: a conversation to prompt token ids.

The ingress, AWQ calibration and the CLI all go through `chat_prompt_ids`, so
a prompt is tokenized the same way wherever it comes from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from transformers import PreTrainedTokenizerBase


def chat_prompt_ids(
    tokenizer: PreTrainedTokenizerBase, conversation: str | Sequence[Mapping[str, str]]
) -> list[int]:
    """Token ids of the conversation (or of one user turn, given a string) with the
    assistant turn opened. The template already holds every special token the model
    expects, so none is added when encoding."""
    if isinstance(conversation, str):
        conversation = [{"role": "user", "content": conversation}]
    text = tokenizer.apply_chat_template(
        [dict(turn) for turn in conversation], tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer.encode(text, add_special_tokens=False))
