"""A model-free engine and tokenizer that honour the engine contract, for deployment tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from engine.config import EngineConfig
from engine.outputs import EngineStats, RequestOutput
from engine.sampling_params import SamplingParams

TOKEN_DELAY_S = 0.005
FAKE_NUM_DRAFTS = 10
"""Drafts a speculating fake reports, each as long as `spec_accepted_per_pos`."""


class FakeTokenizer:
    """One token per character: counts are easy to predict in tests."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(t) for t in token_ids)

    def apply_chat_template(
        self, messages: list[dict[str, str]], tokenize: bool, add_generation_prompt: bool
    ) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


class FakeEngine:
    """Writes a, b, c, ... one token every TOKEN_DELAY_S until max_tokens; tracks live requests."""

    def __init__(self, config: EngineConfig) -> None:
        self.tokenizer = FakeTokenizer()
        self.max_model_len = config.max_model_len or 256
        self._max_num_seqs = config.max_num_seqs
        self._running: set[str] = set()
        self.alive = True
        """Set False to play an engine whose step loop died."""
        self.spec_accepted_per_pos: list[int] = []
        """Accepted draft tokens per position; non-empty plays a speculating engine."""

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt + max_tokens exceeds max_model_len ({self.max_model_len})")
        self._running.add(request_id)
        try:
            for i in range(params.max_tokens):
                await asyncio.sleep(TOKEN_DELAY_S)
                token_id = ord("a") + i % 26
                last = i == params.max_tokens - 1
                yield RequestOutput(
                    request_id=request_id,
                    new_token_ids=[token_id],
                    new_text=chr(token_id),
                    finished=last,
                    finish_reason="length" if last else None,
                    num_prompt_tokens=len(prompt_token_ids),
                    num_output_tokens=i + 1,
                )
        finally:
            self._running.discard(request_id)

    def abort(self, request_id: str) -> None:
        self._running.discard(request_id)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self._running),
            num_waiting=0,
            kv_cache_usage=len(self._running) / self._max_num_seqs,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            num_preemptions=0,
            generation_tokens_per_s=0.0,
            spec_num_drafts=FAKE_NUM_DRAFTS if self.spec_accepted_per_pos else 0,
            spec_num_draft_tokens=FAKE_NUM_DRAFTS * len(self.spec_accepted_per_pos),
            spec_num_accepted_tokens=sum(self.spec_accepted_per_pos),
            spec_accepted_per_pos=list(self.spec_accepted_per_pos),
        )

    def is_alive(self) -> bool:
        return self.alive
