"""A session's exact token history: which tokens a chat request is encoded as.

A session is one rollout. It keeps the messages of its last request followed by the assistant
message it returned, and the tokens of that turn: the prompt and the sampled completion. A request
whose messages extend that conversation (same tools, the earlier messages equal, new ones after)
is encoded as those tokens + the chat template's rendering of the new messages only
(`extend_with_messages`): earlier turns are never tokenized again, so the episode holds exactly
the tokens that were sampled. Any other request is rendered whole and starts a new branch: a
separate episode of the same rollout.

Earlier messages are compared by meaning (`match_key`, `canonical_message`), not as sent:
harnesses rewrite what they send back without changing it (tool-call arguments as parsed JSON,
text stripped, ids and names left out, a null content as "").
"""

from __future__ import annotations

import json
from typing import Any

from rlactors.models.tokenizer import extend_with_messages, render_messages

Message = dict[str, Any]


def template_message(message: Message) -> Message:
    """A canonical message as chat templates expect it: tool-call arguments as an object when they
    are JSON (the wire carries them as a string)."""
    if "tool_calls" not in message:
        return message
    calls = []
    for call in message["tool_calls"]:
        arguments = _parsed(call["function"]["arguments"])
        calls.append({**call, "function": {"name": call["function"]["name"], "arguments": arguments}})
    return {**message, "tool_calls": calls}


def match_key(message: Message) -> tuple[Any, ...]:
    """What a canonical message says, for telling whether a request repeats the history."""
    calls = [(call["function"]["name"], _parsed(call["function"]["arguments"]))
             for call in message.get("tool_calls", ())]
    return message["role"], message["content"].strip(), calls


def _parsed(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


class TokenHistory:
    """The conversation of one session so far, as messages and as the exact tokens of its last turn."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.messages: list[Message] | None = None  # the last request's messages + the reply
        self.keys: list[tuple[Any, ...]] = []  # their match_keys
        self.tools: list[dict[str, Any]] | None = None
        self.token_ids: list[int] = []  # the last prompt + its completion

    def extension(self, messages: list[Message], tools: list[dict[str, Any]] | None) -> list[Message] | None:
        """The messages after the history, when `messages` extend it; None otherwise."""
        if self.messages is None or tools != self.tools:
            return None
        n = len(self.messages)
        if len(messages) <= n:
            return None
        # Harnesses mostly send the history back as they got it: one comparison of the lists, and
        # match_keys (JSON parsing) only for the messages that differ as sent.
        if messages[:n] != self.messages and any(
                sent != kept and match_key(sent) != key for sent, kept, key in zip(messages, self.messages, self.keys)):
            return None
        return messages[n:]

    def prompt(self, messages: list[Message], tools: list[dict[str, Any]] | None,
               new: list[Message] | None) -> list[int]:
        """The prompt tokens of a request whose `extension` is `new` (None: a new branch)."""
        if new is None:
            return render_messages(self.tokenizer, [template_message(m) for m in messages], True, tools)
        return extend_with_messages(self.tokenizer, self.token_ids, [template_message(m) for m in new], True, tools)

    @staticmethod
    def render_chars(messages: list[Message], tools: list[dict[str, Any]] | None) -> int:
        """About how much text rendering `messages` (and `tools`) tokenizes: what its cost grows with."""
        text = sum(len(m["content"]) + sum(len(c["function"]["arguments"]) for c in m.get("tool_calls", ()))
                   for m in messages)
        return text + (len(json.dumps(tools)) if tools else 0)

    def record(self, messages: list[Message], tools: list[dict[str, Any]] | None, new: list[Message] | None,
               prompt: list[int], completion: list[int], reply: Message) -> None:
        """The turn of a request whose `extension` was `new` (None: a new branch): the earlier
        messages' keys carry over, so a turn costs what its new messages do, not the whole history."""
        carried = self.keys if new is not None else []
        self.keys = [*carried, *(match_key(m) for m in messages[len(carried):]), match_key(reply)]
        self.messages = [*messages, reply]
        self.tools = tools
        self.token_ids = [*prompt, *completion]
