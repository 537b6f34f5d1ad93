"""Tool calls in the model's text, Qwen/Hermes style: `<tool_call>{"name": .., "arguments": {..}}</tool_call>`.

The model writes each call as a JSON object between `<tool_call>` tags (the format the Qwen2.5/3
and Hermes chat templates teach). A reply whose tags do not all hold a valid call is returned as
plain text, whole, and counted: the harness sees what the model wrote, not a guess.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


@dataclass
class ParsedReply:
    """The assistant's text without its tool calls, and the calls in OpenAI's shape."""

    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    unparsable: bool = False  # the text has `<tool_call>` tags that do not hold a valid call


def parse_tool_calls(text: str) -> ParsedReply:
    """`text` split into content and tool calls; the whole text as content when a call is malformed."""
    if OPEN not in text:
        return ParsedReply(text)
    blocks = _CALL.findall(text)
    calls = [_call(block) for block in blocks]
    if len(blocks) != text.count(OPEN) or any(c is None for c in calls):
        return ParsedReply(text, unparsable=True)
    return ParsedReply(_CALL.sub("", text).strip(), calls)


def _call(block: str) -> dict[str, Any] | None:
    try:
        value = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}
