"""A streamed reply's content, released as its tokens are sampled, never more than is certain.

Text is decoded incrementally (a character split across tokens comes with its last token). When
the reply may hold tool calls, text that may yet turn out to be one is held back: from a
`<tool_call>` on (or a partial one at the end), trailing whitespace (stripped when a call follows),
and all of a reply that starts with whitespace. So the content released is always a prefix of the
reply's final content, whichever way it ends; `finish` releases the rest. Each token's logprob
entry goes out with the first piece released after it, or with the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlactors.gateway.tool_calls import OPEN

_PARTIAL_OPEN = tuple(OPEN[:i] for i in range(len(OPEN) - 1, 0, -1))  # longest first


class StreamMismatch(RuntimeError):
    """The content released so far is not a prefix of the reply's final content (a bug)."""


class ContentStream:
    def __init__(self, tokenizer: Any, holds_tool_calls: bool,
                 token_logprob: Callable[[int, float], dict[str, Any]] | None) -> None:
        """`token_logprob(token_id, logprob)`: a token's logprob entry; None when not asked for."""
        self.tokenizer = tokenizer
        self.holds_tool_calls = holds_tool_calls
        self.token_logprob = token_logprob
        self.token_ids: list[int] = []
        self.text = ""  # decoded so far, whole characters only
        self.released = 0  # characters of `text` released
        self._logprobs: list[dict[str, Any]] = []  # entries not released yet
        self._prefix_start = 0  # decoding restarts from this token, for context (a leading space)
        self._read_start = 0  # tokens before this one are in `text`

    def feed(self, token_ids: list[int], logprobs: list[float]) -> tuple[str, list[dict[str, Any]] | None] | None:
        """New tokens; the content piece (and logprob entries) to send now, or None."""
        self.token_ids += token_ids
        if self.token_logprob is not None:
            self._logprobs += [self.token_logprob(t, lp) for t, lp in zip(token_ids, logprobs)]
        self._decode()
        end = self._releasable()
        if end <= self.released:
            return None
        piece, self.released = self.text[self.released:end], end
        return piece, self._take_logprobs()

    def finish(self, content: str) -> tuple[str, list[dict[str, Any]] | None]:
        """The rest of the reply's final `content` and the logprob entries not sent yet."""
        sent = self.text[:self.released]
        if not content.startswith(sent):
            raise StreamMismatch(f"streamed {sent!r:.80}, but the reply's content is {content!r:.80}")
        return content[len(sent):], self._take_logprobs()

    def _take_logprobs(self) -> list[dict[str, Any]] | None:
        if self.token_logprob is None:
            return None
        entries, self._logprobs = self._logprobs, []
        return entries

    def _decode(self) -> None:
        decode = self.tokenizer.decode
        before = decode(self.token_ids[self._prefix_start:self._read_start], skip_special_tokens=True)
        now = decode(self.token_ids[self._prefix_start:], skip_special_tokens=True)
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.text += now[len(before):]
            self._prefix_start, self._read_start = self._read_start, len(self.token_ids)

    def _releasable(self) -> int:
        text = self.text
        if not self.holds_tool_calls:
            return len(text)
        if text[:1].isspace():
            return 0  # stripped if a tool call follows, kept if none does: unknown until the end
        end = text.find(OPEN)
        if end < 0:
            end = len(text) - next((len(p) for p in _PARTIAL_OPEN if text.endswith(p)), 0)
        return len(text[:end].rstrip())
