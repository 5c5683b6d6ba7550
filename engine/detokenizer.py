"""Token ids to text deltas, as they arrive, with stop strings cut out.

Byte-level BPE splits one UTF-8 character across tokens, and some tokenizers
only know a token's leading space from its neighbour. So each delta is the
difference between decoding a short window with and without the new tokens,
and nothing is emitted while the window ends in a half character (U+FFFD).
Stop strings may straddle deltas: the last `len(longest stop) - 1`
characters are held back until they can no longer begin one. The stop string
itself is cut out unless the request asks to keep it
(`include_stop_str_in_output`, vLLM's field); special tokens are left out of
the text unless it asks for them (`skip_special_tokens: false`).
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

_CONTEXT_TOKENS = 4
"""Prompt tokens decoded ahead of the output so its first token gets its leading space right."""


class IncrementalDetokenizer:
    """Token ids in, text deltas out: only text whose bytes are complete is released."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0  # start of the window decoded for context
        self.read_offset = len(self.token_ids)  # tokens before this were already emitted

    def push(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the text they complete (possibly empty)."""
        self.token_ids.extend(new_token_ids)
        window = self.token_ids[self.prefix_offset :]
        seen = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(window)
        if len(full) <= len(seen) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return full[len(seen) :]

    def _decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens))


class StopStringFilter:
    """Holds text back just long enough to cut any stop string out of the stream."""

    def __init__(self, stop: tuple[str, ...], include_stop: bool = False) -> None:
        self.stop = stop
        self.include_stop = include_stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.pending = ""

    def push(self, text: str, final: bool) -> tuple[str, bool]:
        """Return (text safe to emit, whether a stop string was hit).

        `final` flushes what is held back: the request ends for another reason.
        """
        buffer = self.pending + text
        hits = [(i, -len(s)) for i, s in ((buffer.find(s), s) for s in self.stop) if i >= 0]
        if hits:  # the earliest stop string; of those starting there, the longest
            start, minus_length = min(hits)
            self.pending = ""
            return buffer[: start - minus_length if self.include_stop else start], True
        cut = len(buffer) if final else max(len(buffer) - self.holdback, 0)
        self.pending = buffer[cut:]
        return buffer[:cut], False
