"""The soak's fuzz corpus: requests a server must refuse with an OpenAI error, never a
plain 500 or a hang (non-finite and out-of-range numbers, broken UTF-8 and JSON, bodies
too large or too deep, unknown routes, tiers and headers)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class BadRequest:
    """One fuzz-corpus entry: raw bytes, so it can be what no JSON library would write."""

    name: str
    content: bytes
    path: str = "/v1/chat/completions"
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)


def _chat(extra: str = "", content: str = '"hi"', max_tokens: str = "2") -> bytes:
    messages = f'[{{"role": "user", "content": {content}}}]'
    return f'{{"model": "m", "messages": {messages}, "max_tokens": {max_tokens}{extra}}}'.encode()


def _completion(prompt: str, extra: str = "") -> bytes:
    return f'{{"model": "m", "prompt": {prompt}, "max_tokens": 2{extra}}}'.encode()


BAD_REQUESTS: tuple[BadRequest, ...] = (
    BadRequest("nan temperature", _chat(', "temperature": NaN')),
    BadRequest("infinite top_p", _chat(', "top_p": Infinity')),
    BadRequest("negative temperature", _chat(', "temperature": -1')),
    BadRequest("top_p above 1", _chat(', "top_p": 2.5')),
    BadRequest("huge seed", _chat(f', "seed": {2**200}')),
    BadRequest("negative seed", _chat(', "seed": -1')),
    BadRequest("float seed", _chat(', "seed": 1.5')),
    BadRequest("max_tokens 0", _chat(max_tokens="0")),
    BadRequest("max_tokens huge", _chat(max_tokens="1e30")),
    BadRequest("max_tokens a string", _chat(max_tokens='"two"')),
    BadRequest("n huge", _chat(', "n": 1000000')),
    BadRequest("top_logprobs huge", _chat(', "logprobs": true, "top_logprobs": 100000')),
    BadRequest("stop list huge", _chat(f', "stop": {json.dumps(["x"] * 10_000)}')),
    BadRequest("stream not bool", _chat(', "stream": "yes"')),
    BadRequest("stream_options without stream", _chat(', "stream_options": {"x": 1}')),
    BadRequest("lone surrogate", _chat(content=r'"\ud800 hi"')),
    BadRequest("nul in content", _chat(content=r'"a\u0000b"')),
    BadRequest("invalid utf-8", _chat(content='"XX"').replace(b"XX", b"\xff\xfe")),
    BadRequest("unknown role", _chat().replace(b'"user"', b'"wizard"')),
    BadRequest("content not text", _chat(content='{"a": [1, 2]}')),
    BadRequest("messages empty", b'{"model": "m", "messages": [], "max_tokens": 2}'),
    BadRequest("messages a string", b'{"model": "m", "messages": "hi", "max_tokens": 2}'),
    BadRequest("deep nesting", _chat(', "x": ' + "[" * 50_000 + "]" * 50_000)),
    BadRequest("empty prompt list", _completion("[]"), "/v1/completions"),
    BadRequest("empty token list", _completion("[[]]"), "/v1/completions"),
    BadRequest("token id past vocab", _completion("[999999999]"), "/v1/completions"),
    BadRequest("negative token id", _completion("[-1, 5]"), "/v1/completions"),
    BadRequest("prompt past context", _completion(json.dumps("word " * 20_000)), "/v1/completions"),
    BadRequest("prompt a number", _completion("42"), "/v1/completions"),
    BadRequest("not json", b"not json at all"),
    BadRequest("empty body", b""),
    BadRequest("json null", b"null"),
    BadRequest("json list", b"[1, 2, 3]"),
    BadRequest("truncated json", _chat()[:-7]),
    BadRequest("body too large", b'{"x": "' + b"a" * 6_000_000 + b'"}'),
    BadRequest("unknown tier header", _chat(), headers={"X-SLA-Tier": "platinum"}),
    BadRequest("unknown tier field", _chat(', "tier": 5')),
    BadRequest("garbled auth header", _chat(), headers={"Authorization": "Basic !!"}),
    BadRequest("wrong content type", _chat(), headers={"Content-Type": "text/plain"}),
    BadRequest("unknown route", b"{}", "/v1/nothing"),
    BadRequest("get on a post route", b"", "/v1/chat/completions", "GET"),
)
