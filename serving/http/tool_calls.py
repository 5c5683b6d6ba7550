"""Tool calls in the default model's format, Hermes (`<tool_call>{"name": ..., "arguments":
...}</tool_call>`, what vLLM's `hermes` parser reads for SmolLM2): the grammar that forces
a call, the parser of a whole output, and the stream that turns text deltas into OpenAI's
tool-call deltas.

The prompt side of the format is engine/model/chat.py's. `tool_choice` `required` or a
named function constrains the output to calls (each call's JSON a `name` and the
function's `parameters` schema, so the arguments always parse and validate); `auto`
lets the model write text or calls and parses what it wrote.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.grammar import json_schema_ebnf
from engine.model.chat import TOOL_CALL_BEGIN, TOOL_CALL_END
from engine.sampling_params import GrammarSpec

MAX_PARALLEL_CALLS = 4
"""Calls a forced output may hold when parallel calls are allowed (the length limit would
otherwise cut a small model's endless list of calls mid-way)."""
_BLOCK = re.compile(rf"{TOOL_CALL_BEGIN}\s*(.*?)\s*{TOOL_CALL_END}", re.DOTALL)
_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')
"""The head of a call object, up to its arguments: enough to stream the name."""
_HOLD = len(TOOL_CALL_END) + 4
"""Argument text held back while streaming: it may yet be the object's `}` and end tag."""


@dataclass(frozen=True)
class ParsedCall:
    """One call the model made: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


def call_id() -> str:
    """A fresh id for a call (OpenAI's `call_` prefix)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def forced_calls_grammar(functions: Mapping[str, Mapping[str, Any]], parallel: bool) -> GrammarSpec:
    """Output that is one call (up to MAX_PARALLEL_CALLS when `parallel`) of the given
    functions (name to JSON-schema parameters), nothing else."""
    call_schema = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": parameters},
                "required": ["name", "arguments"],
            }
            for name, parameters in functions.items()
        ]
    }
    more = f' ("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else ""
    rules = [
        f"root ::= call{more}",
        f'call ::= "{TOOL_CALL_BEGIN}\\n" call_json "\\n{TOOL_CALL_END}"',
        json_schema_ebnf(json.dumps(call_schema), "call_json"),
    ]
    return GrammarSpec("ebnf", "\n".join(rules))


def parse_tool_calls(text: str) -> tuple[str | None, list[ParsedCall]]:
    """The text before the first call (None when empty) and the calls; a block that is
    not a call leaves the whole output as text, as vLLM's parser does."""
    blocks = _BLOCK.findall(text)
    try:
        calls = [call for block in blocks for call in _calls(json.loads(block))]
    except (ValueError, KeyError, TypeError):
        return text, []
    if not calls:
        return text, []
    return text[: text.index(TOOL_CALL_BEGIN)].strip() or None, calls


def _calls(value: Any) -> list[ParsedCall]:
    """A block's calls: one object, or a list of them (SmolLM2's own habit)."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        name, arguments = item["name"], item["arguments"]
        if not isinstance(name, str) or not isinstance(arguments, dict):
            raise TypeError("not a call")
        calls.append(ParsedCall(name, json.dumps(arguments, ensure_ascii=False)))
    return calls


@dataclass(frozen=True)
class CallDelta:
    """What one chunk adds to call `index`: its id and name once, then argument pieces."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass
class ToolCallStream:
    """One choice's text deltas as OpenAI streams a chat with tools: content until the
    first call begins, then each call's id and name once and its arguments in pieces
    (joined, they are the JSON the model wrote)."""

    text: str = ""
    consumed: int = 0
    """Text already sent on, as content or as part of a call."""
    num_calls: int = 0
    arguments_start: int | None = None
    """Where the open call's arguments begin in `text` (None: no call open)."""
    arguments_sent: int = 0
    calls: list[CallDelta] = field(default_factory=list)

    def push(self, new_text: str, final: bool) -> tuple[str, list[CallDelta]]:
        """The content and the call deltas that `new_text` completes (all that is left
        when `final`)."""
        self.text += new_text
        content, deltas = "", list[CallDelta]()
        while True:
            if self.arguments_start is None:
                content += self._content(final)
                if not self._opens_call():
                    return content, deltas
            deltas += self._call_deltas(final)
            if self.arguments_start is not None:  # the call goes on in later text
                return content, deltas

    def _opens_call(self) -> bool:
        """Whether a call's head (up to its name) is complete at `consumed`."""
        begin = self.text.find(TOOL_CALL_BEGIN, self.consumed)
        if begin < 0:
            return False
        head = _NAME.match(self.text, begin + len(TOOL_CALL_BEGIN))
        return head is not None

    def _content(self, final: bool) -> str:
        """Text before any call, less a tail that may begin a call's tag."""
        begin = self.text.find(TOOL_CALL_BEGIN, self.consumed)
        end = begin if begin >= 0 else len(self.text) - (0 if final else _tag_prefix(self.text))
        piece = self.text[self.consumed : end]
        self.consumed = max(self.consumed, end)
        return piece if not self.num_calls or piece.strip() else ""

    def _call_deltas(self, final: bool) -> list[CallDelta]:
        """The open call's new deltas: its head when it opens, then argument pieces."""
        deltas = []
        if self.arguments_start is None:
            begin = self.text.find(TOOL_CALL_BEGIN, self.consumed)
            head = _NAME.match(self.text, begin + len(TOOL_CALL_BEGIN))
            assert head is not None  # _opens_call saw it
            self.arguments_start, self.arguments_sent = head.end(), 0
            name = json.loads(f'"{head.group(1)}"')
            deltas.append(CallDelta(self.num_calls, "", call_id(), name))
        deltas += self._argument_piece(final)
        return deltas

    def _argument_piece(self, final: bool) -> list[CallDelta]:
        """Arguments written since the last piece; at the end tag, the rest and the close."""
        assert self.arguments_start is not None
        index = self.num_calls
        end = self.text.find(TOOL_CALL_END, self.arguments_start)
        if end >= 0 or final:
            stop = end if end >= 0 else len(self.text)
            arguments = self.text[self.arguments_start : stop].rstrip()
            arguments = arguments.removesuffix("}").rstrip() if end >= 0 else arguments
            piece = arguments[self.arguments_sent :]
            self.consumed = stop + len(TOOL_CALL_END) if end >= 0 else stop
            self.arguments_start, self.num_calls = None, self.num_calls + 1
        else:
            ready = len(self.text) - _HOLD
            piece = self.text[self.arguments_start + self.arguments_sent : ready]
            self.arguments_sent += len(piece)
        return [CallDelta(index, piece)] if piece else []


def _tag_prefix(text: str) -> int:
    """Length of the longest tail of `text` that begins TOOL_CALL_BEGIN."""
    for size in range(min(len(text), len(TOOL_CALL_BEGIN) - 1), 0, -1):
        if TOOL_CALL_BEGIN.startswith(text[-size:]):
            return size
    return 0
