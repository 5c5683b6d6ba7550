"""The chat template in one place: a conversation (and the tools it may call) to prompt
token ids.

The ingress, AWQ calibration and the CLI all go through `chat_prompt_ids`, so
a prompt is tokenized the same way wherever it comes from. A template that
renders tools itself (it reads `tools`) gets them and the messages as they
are. One that does not, like the default model's (SmolLM2), gets them in the
Hermes format, which vLLM's `hermes` parser reads for this model: the tools
in the system turn, each call an assistant writes as
`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, each result in
`<tool_response>` tags (serving/http/tool_calls.py parses and constrains the
same format).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

TOOL_CALL_BEGIN, TOOL_CALL_END = "<tool_call>", "</tool_call>"
"""The tags around each call in the Hermes format."""
_TOOLS_PROMPT = (
    "You are a function calling AI model. You are provided with function signatures within "
    "<tools></tools> XML tags. You may call one or more functions to assist with the user "
    "query. Don't make assumptions about what values to plug into functions. Here are the "
    "available tools: <tools>{tools}</tools>\nFor each function call return a json object "
    "with function name and arguments within <tool_call></tool_call> XML tags as follows:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-dict>}}\n</tool_call>'
)

Turn = Mapping[str, Any]


def chat_prompt_ids(
    tokenizer: PreTrainedTokenizerBase,
    conversation: str | Sequence[Turn],
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """Token ids of the conversation (or of one user turn, given a string) with the
    assistant turn opened, the `tools` (OpenAI's function tools) offered to the model.
    The template already holds every special token the model expects, so none is added
    when encoding."""
    if isinstance(conversation, str):
        conversation = [{"role": "user", "content": conversation}]
    turns = [dict(turn) for turn in conversation]
    if not _renders_tools(tokenizer):
        turns, tools = hermes_turns(turns, tools), None
    text = tokenizer.apply_chat_template(
        turns,
        tools=[dict(tool) for tool in tools] if tools else None,
        tokenize=False,
        add_generation_prompt=True,
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def _renders_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the model's own template renders tools (it reads the `tools` variable)."""
    return "tools" in (tokenizer.chat_template or "")


def hermes_turns(
    turns: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> list[dict[str, Any]]:
    """The conversation as plain text turns in the Hermes format, for a template that
    renders only roles and contents."""
    rendered = [_hermes_turn(turn) for turn in turns]
    if not tools:
        return rendered
    prompt = _TOOLS_PROMPT.format(tools=json.dumps(list(tools), ensure_ascii=False))
    if rendered and rendered[0]["role"] == "system":
        first = rendered[0]
        return [{**first, "content": f"{first['content']}\n\n{prompt}"}, *rendered[1:]]
    return [{"role": "system", "content": prompt}, *rendered]


def _hermes_turn(turn: dict[str, Any]) -> dict[str, Any]:
    """One turn with its tool calls (or its tool result) written into its content."""
    content = turn.get("content") or ""
    if turn["role"] == "tool":
        content = f"<tool_response>\n{content}\n</tool_response>"
    calls = [
        json.dumps({"name": call["function"]["name"], "arguments": _arguments(call)})
        for call in turn.get("tool_calls") or ()
    ]
    parts = [content] if content else []
    content = "\n".join(parts + [_tagged(call) for call in calls])
    return {"role": turn["role"], "content": content}


def _arguments(call: Mapping[str, Any]) -> Any:
    """A call's arguments as a JSON value (OpenAI sends them as JSON text)."""
    arguments = call["function"].get("arguments") or "{}"
    return json.loads(arguments) if isinstance(arguments, str) else arguments


def _tagged(call_json: str) -> str:
    return f"{TOOL_CALL_BEGIN}\n{call_json}\n{TOOL_CALL_END}"
