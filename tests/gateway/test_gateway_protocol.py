"""The gateway's HTTP surface with a scripted model: every bad request gets its OpenAI-style 4xx
and changes nothing, the API key is required, tool calls are parsed, and a session's tokens extend
exactly. (Real Monarch procs and the native engine: test_gateway_agents.py.)"""

from __future__ import annotations

import asyncio
import gc
import json
import sys
import threading

import aiohttp
import pytest

from rlactors.config import GatewayConfig
from rlactors.gateway import AgentEnv, Gateway
from rlactors.gateway.server import INLINE_RENDER_CHARS
from rlactors.gateway.tool_calls import parse_tool_calls
from rlactors.models import extend_with_messages, load_tokenizer, render_messages
from rlactors.rollout import RolloutStatus, Turn, TurnRefused
from rlactors.types import TokenDelta

TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'


class ScriptedModel:
    """A rollout's `model` that replies with the given texts in turn (then refuses, as at max_turns),
    streamed one token at a time when asked. A reply None: the generator fails after two tokens; a
    reply (text, "length"): the turn is cut by max_tokens after the text (no EOS)."""

    def __init__(self, tokenizer, replies: list[str | None]):
        self.tokenizer, self.replies, self.prompts = tokenizer, list(replies), []

    async def __call__(self, prompt, max_tokens=None, stop_token_ids=(), on_tokens=None):
        if not self.replies:
            raise TurnRefused(RolloutStatus.TRUNCATED_TURNS, "the rollout has had its rollout.max_turns=2 turns")
        self.prompts.append(list(prompt))
        reply, finish_reason = self.replies.pop(0), "stop"
        if isinstance(reply, tuple):
            reply, finish_reason = reply
        eos = [self.tokenizer.eos_token_id] if finish_reason == "stop" else []
        ids = self.tokenizer.encode(reply or "Ada Ben", add_special_tokens=False) + eos
        for i, token in enumerate(ids if on_tokens else ()):
            if reply is None and i == 2:
                break
            await on_tokens(TokenDelta(i, [token], [-0.5 - i], [3]))
            await asyncio.sleep(0.005)  # a decode step
        if reply is None:
            raise TurnRefused(RolloutStatus.ERROR_GENERATOR, "every replica died")
        return Turn(list(prompt), ids, [-0.5 - i for i in range(len(ids))], [3] * len(ids), finish_reason)


def serve(tiny_ckpt, replies, test, **config):
    tokenizer = load_tokenizer(tiny_ckpt)

    async def main():
        gateway = Gateway(GatewayConfig(**config), tokenizer, max_tokens=16)
        await gateway.start()
        model = ScriptedModel(tokenizer, replies)
        try:
            async with gateway.session(model) as info, aiohttp.ClientSession() as http:
                return await test(gateway, info, http, model, tokenizer)
        finally:
            await gateway.stop()

    return asyncio.run(main())


def post(http, info, body, key=None, raw=None, path="/chat/completions"):
    headers = {"Authorization": f"Bearer {key or info.api_key}", "Content-Type": "application/json"}
    return http.post(info.base_url + path, data=raw if raw is not None else json.dumps(body), headers=headers)


USER = [{"role": "user", "content": "Add 2 and 3."}]
GOOD = {"model": "m", "messages": USER}
BAD_REQUESTS = [  # (body changes, param named in the error)
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"messages": [{"role": "tool", "content": "4"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}]},
     "messages[0].tool_calls[0]"),
    ({"messages": USER * 5}, "messages"),  # more than gateway.max_messages=4
    ({"model": 3}, "model"),
    ({"max_tokens": 17}, "max_tokens"),  # beyond rollout.max_tokens_per_turn=16
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_tokens": "8"}, "max_tokens"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 2}, "n"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"stop": "two words"}, "stop"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {**TOOLS[0]["function"], "strict": "yes"}}]},
     "tools[0].function.strict"),
    ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"stream": "yes"}, "stream"),
]


@pytest.mark.parametrize("change,param", BAD_REQUESTS, ids=[p for _, p in BAD_REQUESTS])
def test_a_bad_request_gets_its_400_and_changes_nothing(tiny_ckpt, change, param):
    async def test(gateway, info, http, model, tokenizer):
        async with post(http, info, {**GOOD, **change}) as r:
            error = (await r.json())["error"]
            assert r.status == 400 and error["type"] == "invalid_request_error" and error["param"] == param
            assert error["message"]
        assert model.prompts == [] and gateway.counters["requests"] == 0  # nothing was generated
        async with post(http, info, GOOD) as r:  # and the session serves on
            assert r.status == 200 and (await r.json())["choices"][0]["message"]["content"] == "5"

    serve(tiny_ckpt, ["5"], test, max_messages=4)


def test_http_level_errors_are_openai_json(tiny_ckpt):
    async def test(gateway, info, http, model, tokenizer):
        cases = [
            (post(http, info, GOOD, key="rla-wrong"), 401, "invalid_api_key"),
            (http.post(info.base_url + "/chat/completions", json=GOOD), 401, "invalid_api_key"),  # no key
            (post(http, info, None, raw="{not json"), 400, None),
            (post(http, info, None, raw=b"\xff\xfe{}"), 400, None),
            (post(http, info, None, raw=json.dumps({**GOOD, "pad": "x" * 5000})), 413, None),
            (http.post(info.base_url.replace(info.session_id, "guessed") + "/chat/completions", json=GOOD,
                       headers={"Authorization": f"Bearer {info.api_key}"}), 404, "session_not_found"),
            (post(http, info, GOOD, path="/completions"), 404, None),
            (http.get(info.base_url + "/chat/completions", headers={"Authorization": f"Bearer {info.api_key}"}),
             405, None),
        ]
        for request, status, code in cases:
            async with request as r:
                error = (await r.json())["error"]
                assert r.status == status and error["code"] == code and error["message"], (status, error)
        assert model.prompts == []
        async with http.get(info.base_url + "/models", headers={"Authorization": f"Bearer {info.api_key}"}) as r:
            assert r.status == 200 and (await r.json())["data"][0]["object"] == "model"

    serve(tiny_ckpt, [], test, max_request_bytes=4096)


def test_tools_are_parsed_and_a_conversation_extends_its_exact_tokens(tiny_ckpt):
    async def test(gateway, info, http, model, tokenizer):
        async with post(http, info, {**GOOD, "tools": TOOLS, "logprobs": True}) as r:
            body = await r.json()
        choice = body["choices"][0]
        call = choice["message"]["tool_calls"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        assert call["function"] == {"name": "calculator", "arguments": '{"expression": "2 + 3"}'}
        completion = tokenizer.encode(CALL, add_special_tokens=False) + [tokenizer.eos_token_id]
        assert [t["logprob"] for t in choice["logprobs"]["content"]] == [-0.5 - i for i in range(len(completion))]
        assert body["usage"] == {"prompt_tokens": len(model.prompts[0]), "completion_tokens": len(completion),
                                 "total_tokens": len(model.prompts[0]) + len(completion)}
        # The harness echoes the reply (with fields of its own) and adds the tool's result.
        tool = {"role": "tool", "tool_call_id": call["id"], "content": "5"}
        history = USER + [{**choice["message"], "refusal": None}, tool]
        async with post(http, info, {**GOOD, "messages": history, "tools": TOOLS}) as r:
            assert (await r.json())["choices"][0]["message"] == {"role": "assistant", "content": "It is 5."}
        first = render_messages(tokenizer, USER, tools=TOOLS)
        assert model.prompts == [first, extend_with_messages(tokenizer, first + completion, [tool], tools=TOOLS)]
        assert gateway.counters["branches"] == 0 and gateway.counters["tool_calls"] == 1
        # An edited history (the tool call's result changed) is rendered whole: a new branch.
        edited = USER + [choice["message"], {**tool, "content": "6"}]
        async with post(http, info, {**GOOD, "messages": edited, "tools": TOOLS}) as r:
            assert r.status == 200
        assert model.prompts[2] == render_messages(tokenizer, [*USER, {**edited[1], "content": "", "tool_calls": [
            {**call, "function": {"name": "calculator", "arguments": {"expression": "2 + 3"}}}]}, edited[2]],
            tools=TOOLS)
        assert gateway.counters["branches"] == 1
        # Past the rollout's limits: a 400 that says why.
        async with post(http, info, GOOD) as r:
            error = (await r.json())["error"]
            assert r.status == 400 and error["code"] == "truncated_turns" and "max_turns" in error["message"]
        assert gateway.step_metrics()["gateway/requests"] == 4 and gateway.step_metrics()["gateway/requests"] == 0

    serve(tiny_ckpt, [CALL, "It is 5.", "It is 6."], test)


def test_tool_call_parsing_hermes_style():
    ok = parse_tool_calls('Let me compute.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>')
    assert ok.content == "Let me compute." and not ok.unparsable
    assert [c["function"] for c in ok.tool_calls] == [{"name": "f", "arguments": '{"x": 1}'}]
    two = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>'
                           '<tool_call>{"name": "g"}</tool_call>')
    assert [c["function"] for c in two.tool_calls] == [{"name": "f", "arguments": '{"x": 2}'},
                                                        {"name": "g", "arguments": "{}"}]
    assert len({c["id"] for c in two.tool_calls}) == 2
    for broken in ['<tool_call>{"name": "f", </tool_call>', '<tool_call>{"name": "f"}', '<tool_call>[1]</tool_call>',
                   '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"name": "f", "arguments": 3}</tool_call>',
                   '<tool_call>{"name": "f"}</tool_call> <tool_call>oops</tool_call>']:
        parsed = parse_tool_calls(broken)
        assert parsed.unparsable and parsed.content == broken and parsed.tool_calls == []
    assert parse_tool_calls("plain") == parse_tool_calls("plain") and not parse_tool_calls("plain").unparsable


def test_tools_need_a_template_that_renders_them(tmp_path, tiny_ckpt):
    config = json.loads((tiny_ckpt / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    for name in ("tokenizer.json", "config.json"):
        (tmp_path / name).write_bytes((tiny_ckpt / name).read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))

    async def test(gateway, info, http, model, tokenizer):
        async with post(http, info, {**GOOD, "tools": TOOLS}) as r:
            error = (await r.json())["error"]
            assert r.status == 400 and error["param"] == "tools" and "does not render tools" in error["message"]

    serve(tmp_path, [], test)


def events_of(text: str) -> list:
    """The JSON events of an SSE body, which must end with [DONE]."""
    events = [line[len("data: "):] for line in text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_a_stream_sends_each_token_as_it_comes_with_the_same_reply_and_usage(tiny_ckpt):
    reply = "Ada Ben Cleo é"  # a two-byte character: pieces split only between whole characters

    async def test(gateway, info, http, model, tokenizer):
        async with post(http, info, {**GOOD, "logprobs": True}) as r:
            whole = (await r.json())["choices"][0]
        request = {**GOOD, "messages": USER + [whole["message"], *USER], "logprobs": True, "stream": True,
                   "stream_options": {"include_usage": True}}
        async with post(http, info, request) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            chunks = events_of(await r.text())
        deltas = [c["choices"][0] for c in chunks if c["choices"]]
        assert deltas[0]["delta"] == {"role": "assistant", "content": ""}
        pieces = [d["delta"]["content"] for d in deltas[1:] if d["delta"].get("content")]
        assert "".join(pieces) == reply == whole["message"]["content"]
        completion = tokenizer.encode(reply, add_special_tokens=False) + [tokenizer.eos_token_id]
        assert len(pieces) >= len(completion) - 2  # token by token (a split character comes whole)
        logprobs = [lp for d in deltas if d["logprobs"] for lp in d["logprobs"]["content"]]
        assert logprobs == whole["logprobs"]["content"]
        assert [lp["logprob"] for lp in logprobs] == [-0.5 - i for i in range(len(completion))]
        assert deltas[-1]["finish_reason"] == "stop" and chunks[-1]["choices"] == []
        assert chunks[-1]["usage"]["completion_tokens"] == len(completion)
        assert model.prompts[1] == extend_with_messages(tokenizer, model.prompts[0] + completion, USER)

    serve(tiny_ckpt, [reply, reply], test)


def test_a_streamed_tool_call_is_never_sent_as_content(tiny_ckpt):
    text = "Let me compute.\n" + CALL

    async def test(gateway, info, http, model, tokenizer):
        async with post(http, info, {**GOOD, "tools": TOOLS}) as r:
            whole = (await r.json())["choices"][0]
        async with post(http, info, {**GOOD, "tools": TOOLS, "stream": True}) as r:
            deltas = [c["choices"][0] for c in events_of(await r.text())]
        pieces = [d["delta"]["content"] for d in deltas if d["delta"].get("content")]
        assert len(pieces) > 2 and "".join(pieces) == whole["message"]["content"] == "Let me compute."
        calls = [d["delta"]["tool_calls"] for d in deltas if "tool_calls" in d["delta"]]
        assert [c[0]["function"] for c in calls] == [whole["message"]["tool_calls"][0]["function"]]
        assert calls[0][0]["index"] == 0 and calls[0][0]["id"].startswith("call_")
        assert deltas[-1]["finish_reason"] == "tool_calls"

    serve(tiny_ckpt, [text, text], test)


def test_a_generator_failure_mid_stream_ends_it_with_an_error_event(tiny_ckpt):
    async def test(gateway, info, http, model, tokenizer):
        async with post(http, info, {**GOOD, "stream": True}) as r:
            assert r.status == 200
            chunks = events_of(await r.text())
        assert [c["choices"][0]["delta"] for c in chunks[:-1]][0] == {"role": "assistant", "content": ""}
        sent = tokenizer.decode(tokenizer.encode("Ada Ben", add_special_tokens=False)[:2])
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == sent
        assert chunks[-1]["error"]["type"] == "server_error" and "every replica died" in chunks[-1]["error"]["message"]
        # Refused before any token: a plain JSON error.
        async with post(http, info, {**GOOD, "stream": True}) as r:
            assert r.status == 400 and (await r.json())["error"]["code"] == "truncated_turns"

    serve(tiny_ckpt, [None], test)


def test_a_client_that_leaves_mid_stream_loses_nothing_of_its_turn(tiny_ckpt):
    reply = "Ada Ben Cleo Dora Emil Fay Gus"

    async def test(gateway, info, http, model, tokenizer):
        async with post(http, info, {**GOOD, "stream": True}) as r:
            await r.content.readline()  # the role chunk, then gone
            r.close()
        history = gateway._sessions[info.session_id].history
        while history.messages is None:
            await asyncio.sleep(0.01)
        async with post(http, info, {**GOOD, "messages": USER + [{"role": "assistant", "content": reply}, *USER]}) as r:
            assert r.status == 200
        completion = tokenizer.encode(reply, add_special_tokens=False) + [tokenizer.eos_token_id]
        assert model.prompts[1] == extend_with_messages(tokenizer, model.prompts[0] + completion, USER)
        assert gateway.counters["branches"] == 0

    serve(tiny_ckpt, [reply, reply], test)


def test_an_agent_env_that_builds_its_own_client_gets_none(tiny_ckpt):
    class OwnClient(AgentEnv):
        openai_client = False

        async def run(self, sample, client):
            assert client is None
            async with aiohttp.ClientSession() as http, http.post(
                    f"{self.base_url}/chat/completions", json=GOOD,
                    headers={"Authorization": f"Bearer {self.api_key}"}) as r:
                return float((await r.json())["choices"][0]["message"]["content"])

    tokenizer = load_tokenizer(tiny_ckpt)

    async def main():
        gateway = Gateway(GatewayConfig(), tokenizer, max_tokens=16)
        await gateway.start()
        env = OwnClient(None, tokenizer)
        env.gateway = gateway
        try:
            return await env.play({}, ScriptedModel(tokenizer, ["5"]))
        finally:
            await gateway.stop()

    assert asyncio.run(main()) == 5.0


def test_the_collector_is_tuned_while_the_gateway_serves_and_restored_after(tiny_ckpt):
    before = gc.get_threshold(), gc.get_freeze_count()

    async def test(gateway, info, http, model, tokenizer):
        assert gc.get_threshold()[0] == 20_000 and gc.get_freeze_count() > before[1]

    serve(tiny_ckpt, [], test)
    assert (gc.get_threshold(), gc.get_freeze_count()) == before


def test_without_the_openai_package_the_gateway_does_not_start(tiny_ckpt, monkeypatch):
    monkeypatch.setitem(sys.modules, "openai", None)  # as if not installed
    gateway = Gateway(GatewayConfig(), load_tokenizer(tiny_ckpt), max_tokens=16)
    with pytest.raises(ImportError, match=r"pip install 'rlactors\[agents\]'"):
        asyncio.run(gateway.start())
    assert gateway.port is None


def test_a_harness_that_rewrites_the_history_it_sends_back_extends_the_sampled_tokens(tiny_ckpt):
    """Harnesses send earlier turns back rewritten without changing what they say: arguments
    re-serialised or parsed, their own tool-call ids, null for "", content as text parts, a name on
    a tool result, whitespace trimmed. Each turn still extends the sampled tokens: no branch."""
    async def test(gateway, info, http, model, tokenizer):
        completions = []

        async def turn(messages):
            async with post(http, info, {**GOOD, "messages": messages, "tools": TOOLS}) as r:
                assert r.status == 200, await r.text()
                message = (await r.json())["choices"][0]["message"]
            completions.append(model.prompts[-1] + model.tokenizer.encode(
                model_texts.pop(0), add_special_tokens=False) + [tokenizer.eos_token_id])
            return message

        model_texts = [CALL, CALL, "It is 5.", "Bye."]
        first = await turn(USER)
        assert first["tool_calls"][0]["function"]["arguments"] == '{"expression": "2 + 3"}'
        # Arguments re-serialised compactly, null content, the harness's own call id (and its tool result's).
        assistant = {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
            {"id": "call_0", "type": "function",
             "function": {"name": "calculator", "arguments": '{"expression":"2 + 3"}'}}]}
        tool = {"role": "tool", "tool_call_id": "call_0", "name": "calculator", "content": "5"}
        await turn(USER + [assistant, tool])
        # Arguments sent parsed; content as text parts; no id on the call.
        parts = [{"role": "user", "content": [{"type": "text", "text": "Add 2 "}, {"type": "text", "text": "and 3."}]}]
        again = {"role": "assistant", "content": "", "tool_calls": [
            {"id": "x", "function": {"name": "calculator", "arguments": {"expression": "2 + 3"}}}]}
        answer = await turn(parts + [assistant, tool, again, {**tool, "tool_call_id": "x"}])
        assert answer == {"role": "assistant", "content": "It is 5."}
        # The text reply trimmed.
        history = USER + [assistant, tool, again, {**tool, "tool_call_id": "x"}, {**answer, "content": "It is 5.\n"}]
        await turn(history + [{"role": "user", "content": "Thanks."}])
        assert gateway.counters["branches"] == 0
        news = [[tool], [{**tool, "tool_call_id": "x"}], [{"role": "user", "content": "Thanks."}]]
        for k, new in enumerate(news, start=1):
            assert model.prompts[k] == extend_with_messages(tokenizer, completions[k - 1], new, tools=TOOLS)
        # What the arguments say changed: rendered whole, a new branch.
        changed = {**assistant, "tool_calls": [{**assistant["tool_calls"][0], "function": {
            "name": "calculator", "arguments": '{"expression":"2 + 4"}'}}]}
        model.replies.append("It is 6.")
        async with post(http, info, {**GOOD, "messages": USER + [changed, tool], "tools": TOOLS}) as r:
            assert r.status == 200
        assert gateway.counters["branches"] == 1 and model.prompts[-1][:len(completions[0])] != completions[0]

    serve(tiny_ckpt, [CALL, CALL, "It is 5.", "Bye."], test)


def test_strict_tools_are_accepted_and_not_shown_to_the_model(tiny_ckpt):
    strict = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]

    async def test(gateway, info, http, model, tokenizer):
        async with post(http, info, {**GOOD, "tools": strict}) as r:
            choice = (await r.json())["choices"][0]
        assert r.status == 200 and choice["finish_reason"] == "tool_calls"
        assert model.prompts == [render_messages(tokenizer, USER, tools=TOOLS)]

    serve(tiny_ckpt, [CALL], test)


@pytest.mark.parametrize("stream", [False, True])
def test_a_turn_cut_by_max_tokens_is_length_even_with_a_whole_tool_call(tiny_ckpt, stream):
    async def test(gateway, info, http, model, tokenizer):
        async with post(http, info, {**GOOD, "tools": TOOLS, "stream": stream}) as r:
            if stream:
                deltas = [c["choices"][0] for c in events_of(await r.text())]
                calls = [d["delta"]["tool_calls"][0] for d in deltas if "tool_calls" in d["delta"]]
                finish_reason = deltas[-1]["finish_reason"]
            else:
                choice = (await r.json())["choices"][0]
                calls, finish_reason = choice["message"]["tool_calls"], choice["finish_reason"]
        assert finish_reason == "length"
        assert [c["function"] for c in calls] == [{"name": "calculator", "arguments": '{"expression": "2 + 3"}'}]

    serve(tiny_ckpt, [(CALL, "length")], test)


def test_a_large_request_renders_off_the_event_loop_while_other_sessions_are_served(tiny_ckpt):
    """A prompt of more than INLINE_RENDER_CHARS renders on a render thread: here one whose render
    waits on an Event, released only after another session's turn completed (inline, that turn
    could not run until the wait timed out). With gateway.render_threads=1, a second large request
    waits for the first."""
    tokenizer = load_tokenizer(tiny_ckpt)
    big = {**GOOD, "messages": [{"role": "user", "content": "Add 2 and 3. " * 200}]}
    assert len(big["messages"][0]["content"]) > INLINE_RENDER_CHARS

    async def main():
        gateway = Gateway(GatewayConfig(render_threads=1), tokenizer, max_tokens=16)
        await gateway.start()
        release, renders = threading.Event(), []
        try:
            async with gateway.session(ScriptedModel(tokenizer, ["A"])) as a, \
                    gateway.session(ScriptedModel(tokenizer, ["B"])) as b, \
                    gateway.session(ScriptedModel(tokenizer, ["C"])) as c, aiohttp.ClientSession() as http:
                history = gateway._sessions[a.session_id].history
                prompt = history.prompt

                def blocked(*args):
                    renders.append(("a", threading.current_thread().name))
                    assert release.wait(60)
                    return prompt(*args)

                history.prompt = blocked
                c_history = gateway._sessions[c.session_id].history
                c_prompt = c_history.prompt
                c_history.prompt = lambda *args: renders.append(("c", None)) or c_prompt(*args)
                large_a = asyncio.ensure_future(post(http, a, big).__aenter__())
                while not renders:
                    await asyncio.sleep(0.01)
                large_c = asyncio.ensure_future(post(http, c, big).__aenter__())
                async with post(http, b, GOOD) as r:  # a small request of another session, while `a` renders
                    assert r.status == 200 and (await r.json())["choices"][0]["message"]["content"] == "B"
                assert renders == [("a", renders[0][1])] and renders[0][1].startswith("gateway-render")
                release.set()
                for future, reply in ((large_a, "A"), (large_c, "C")):
                    r = await future
                    assert r.status == 200 and (await r.json())["choices"][0]["message"]["content"] == reply
                    r.release()
                assert [who for who, _ in renders] == ["a", "c"]
        finally:
            release.set()
            await gateway.stop()

    asyncio.run(main())
