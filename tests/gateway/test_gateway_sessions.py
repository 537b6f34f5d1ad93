"""TokenHistory's matching without a server: which requests extend the history, and that a turn's
matching work grows with its new messages, not with the whole conversation."""

from __future__ import annotations

import pytest

from rlactors.gateway import sessions
from rlactors.gateway.protocol import canonical_message
from rlactors.gateway.sessions import TokenHistory, match_key


def conversation(turns: int) -> list[dict]:
    """A canonical agent conversation: a question, then `turns` tool calls and their results."""
    messages = [{"role": "user", "content": "Compute."}]
    for i in range(turns):
        arguments = f'{{"expression": "{i} + 1"}}'
        call = {"id": f"c{i}", "type": "function", "function": {"name": "calc", "arguments": arguments}}
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": str(i + 1)})
    return [canonical_message(m, i) for i, m in enumerate(messages)]


def played(turns: int) -> TokenHistory:
    """A history of `turns` turns, each extending the last (a tool's result the new message): the
    conversation up to the last tool call."""
    messages, history = conversation(turns), TokenHistory(tokenizer=None)
    history.record(messages[:1], None, None, [1], [2], messages[1])
    for end in range(3, len(messages), 2):
        new = history.extension(messages[:end], None)
        assert new == messages[end - 1:end]
        history.record(messages[:end], None, new, [1], [2], messages[end])
    return history


def test_keys_carried_over_the_turns_are_those_of_the_whole_history():
    history = played(4)
    assert history.messages == conversation(4)[:-1]
    assert history.keys == [match_key(m) for m in history.messages]


def test_a_history_sent_back_as_received_is_matched_without_parsing_it(monkeypatch):
    history = played(30)
    parsed = []
    monkeypatch.setattr(sessions, "match_key", lambda m: parsed.append(m) or match_key(m))
    follow_up = {"role": "user", "content": "And now?"}
    new = history.extension([*history.messages, follow_up], None)
    history.record([*history.messages, follow_up], None, new, [1], [2], {"role": "assistant", "content": "61."})
    assert new == [follow_up]
    assert parsed == [follow_up, {"role": "assistant", "content": "61."}]  # the new message and the reply only
    assert history.keys == [match_key(m) for m in history.messages]


@pytest.mark.parametrize("arguments, extends", [('{"expression":"0 + 1"}', True), ('{"expression": "0 + 2"}', False)])
def test_an_earlier_message_sent_back_rewritten_is_matched_by_meaning(arguments, extends):
    history = played(3)
    sent = [dict(m) for m in history.messages]
    sent[1] = {**sent[1], "tool_calls": [{**sent[1]["tool_calls"][0], "function": {"name": "calc",
                                                                                     "arguments": arguments}}]}
    follow_up = {"role": "user", "content": "Thanks."}
    assert history.extension([*sent, follow_up], None) == ([follow_up] if extends else None)
    new = history.extension([*sent, follow_up], None)
    history.record([*sent, follow_up], None, new, [1], [2], {"role": "assistant", "content": "Bye."})
    assert history.keys == [match_key(m) for m in history.messages]
