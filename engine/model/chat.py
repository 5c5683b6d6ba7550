"""The chat template in one place: a user message to prompt token ids."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of one user turn with the assistant turn opened (transformers 5 gives a dict)."""
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )
    return list(encoded["input_ids"])  # type: ignore[arg-type,call-overload,index]
