"""ContentStream: what a streamed reply releases token by token is always a prefix of the reply's
final content (tool calls parsed out and stripped, or kept whole when unparsable), and never a
piece of `<tool_call>` markup."""

from __future__ import annotations

import pytest

from rlactors.gateway.streaming import ContentStream, StreamMismatch
from rlactors.gateway.tool_calls import parse_tool_calls
from rlactors.models import load_tokenizer

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(tiny_ckpt):
    return load_tokenizer(tiny_ckpt)


def stream(tokenizer, text: str, holds_tool_calls: bool = True) -> tuple[list[str], str]:
    """The pieces released token by token, and the rest `finish` releases."""
    content = ContentStream(tokenizer, holds_tool_calls, lambda t, lp: {"token": t, "logprob": lp})
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    pieces, logprobs = [], []
    for i, token in enumerate(ids):
        released = content.feed([token], [-float(i)])
        if released is not None:
            pieces.append(released[0])
            logprobs += released[1]
    decoded = tokenizer.decode(ids, skip_special_tokens=True)
    final = parse_tool_calls(decoded).content if holds_tool_calls else decoded
    rest, last = content.finish(final)
    assert [e["logprob"] for e in logprobs + last] == [-float(i) for i in range(len(ids))]
    assert "".join(pieces) + rest == final
    return pieces, rest


@pytest.mark.parametrize("text", [
    "Let me compute.\n" + CALL,  # the content before the call streams; the whitespace before it is stripped
    "  " + CALL,  # leading whitespace, stripped with a call after it
    "  plain, but it started with spaces",
    "a <tool is not a call <tool_c",  # partial tags, released once they are not one
    "Before " + CALL + " after",  # text after a call is only known at the end
    "<tool_call>not json</tool_call> kept whole",  # unparsable: the whole text is the content
    "héllo wörld",  # characters split across tokens come whole
])
def test_released_content_is_a_prefix_of_the_final_one_and_never_markup(tokenizer, text):
    pieces, rest = stream(tokenizer, text)
    assert "<tool_call>" not in "".join(pieces) and not "".join(pieces).endswith(("<", "<tool_c"))
    if text.startswith("Let me"):
        assert "".join(pieces) == "Let me compute." and len(pieces) > 3 and rest == ""
    if text.startswith("a <tool"):
        assert "".join(pieces) == "a <tool is not a call" and rest == " <tool_c"


def test_without_tools_everything_streams_at_once(tokenizer):
    text = "  " + CALL
    pieces, rest = stream(tokenizer, text, holds_tool_calls=False)
    assert "".join(pieces) == text and rest == ""


def test_a_final_content_that_does_not_extend_what_was_sent_is_refused(tokenizer):
    content = ContentStream(tokenizer, False, None)
    assert content.feed(tokenizer.encode("Ada", add_special_tokens=False), [0.0]) == ("Ada", None)
    with pytest.raises(StreamMismatch, match="streamed 'Ada'"):
        content.finish("Bob")
