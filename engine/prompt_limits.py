"""What a request may ask of an engine: the numbers its validation needs, and the check.

A frozen value, not a method of the engine, so a front whose engine steps in
another process refuses a bad request at once, in the caller, with the same
error the engine itself would raise. Each request is checked once, at the
engine's API it came in by: `AsyncLLMEngine.generate` (its loop then queues it
with `LLMEngine.enqueue`, unchecked) or `LLMEngine.add_request`.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class PromptLimits:
    """An engine's context limit, KV cache capacity and vocabulary size."""

    max_model_len: int
    kv_capacity_tokens: int
    vocab_size: int

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming the field and the limit; allocates nothing."""
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise ValueError("prompt must not be empty (prompt_token_ids has 0 tokens)")
        if num_prompt >= self.max_model_len:
            raise ValueError(
                f"prompt has {num_prompt} tokens; the context limit max_model_len is "
                f"{self.max_model_len}, which leaves no room to generate"
            )
        total = num_prompt + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({num_prompt} tokens) + max_tokens ({params.max_tokens}) = "
                f"{total} exceeds max_model_len ({self.max_model_len})"
            )
        if total > self.kv_capacity_tokens:
            raise ValueError(
                f"prompt + max_tokens = {total} tokens exceeds the KV "
                f"cache capacity of {self.kv_capacity_tokens} tokens"
            )
        if any(not 0 <= t < self.vocab_size for t in prompt_token_ids):
            raise ValueError(f"prompt_token_ids must be in [0, {self.vocab_size})")
        self._check_sampling_token_ids(params)

    def _check_sampling_token_ids(self, params: SamplingParams) -> None:
        """The token ids a request's sampling names must index the logits."""
        named = {
            "logit_bias": [token_id for token_id, _ in params.logit_bias],
            "stop_token_ids": params.stop_token_ids,
        }
        for name, token_ids in named.items():
            if any(t >= self.vocab_size for t in token_ids):
                message = f"{name} token ids must be below the vocabulary size {self.vocab_size}"
                raise ValueError(message)
