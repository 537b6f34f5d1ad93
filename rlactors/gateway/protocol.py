"""The OpenAI Chat Completions wire format: request validation, responses, stream chunks, errors.

A request is checked whole before anything is generated; whatever the gateway cannot honour
exactly (several choices, forced tool choice, sampling knobs the run fixes, stop strings that are
not one token) is refused with an OpenAI-style 4xx error, never silently ignored. Sampling
temperature and top-p are accepted (range-checked) but the run's `rollout` config decides how the
policy samples: the trainer learns from the distribution it configured. For the same reason a
tool's `strict: true` is accepted and not enforced: the arguments are never constrained to its schema.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
Message = dict[str, Any]


class ApiError(Exception):
    """An error answered as OpenAI does: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class RequestLimits:
    max_messages: int
    max_tokens: int  # rollout.max_tokens_per_turn


@dataclass
class ChatRequest:
    """A valid request, its messages in canonical form (`canonical_message`)."""

    model: str
    messages: list[Message]
    tools: list[dict[str, Any]] | None
    max_tokens: int | None
    stop_token_ids: tuple[int, ...]
    parse_tool_calls: bool
    stream: bool
    include_usage: bool
    logprobs: bool


def _bad(message: str, param: str, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


def _int(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise _bad(f"{key} must be an integer, got {value!r}", key)
    return value


def _number_in(body: dict[str, Any], key: str, low: float, high: float, low_open: bool = False) -> None:
    value = body.get(key)
    if value is None:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and (value > low if low_open else value >= low) and value <= high
    if not ok:
        raise _bad(f"{key} must be a number in {'(' if low_open else '['}{low}, {high}], got {value!r}", key)


def _text(content: Any, where: str) -> str:
    """Message content as text: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise _bad(f"{where}: only text content parts are supported, got {part!r:.80}", where)
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"{where}: content must be a string or a list of text parts, got {type(content).__name__}", where)


def canonical_message(message: Any, i: int) -> Message:
    """The fields of a message that its rendering depends on, in one form, so that the assistant
    message a harness sends back compares equal to the one the gateway returned."""
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise _bad(f"{where} must be an object, got {type(message).__name__}", where)
    role = message.get("role")
    if role not in ROLES:
        raise _bad(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
    out: Message = {"role": role}
    tool_calls = message.get("tool_calls") if role == "assistant" else None
    content = message.get("content")
    if content is None and role != "assistant":  # an assistant's empty reply comes back as null from some harnesses
        raise _bad(f"{where}.content is missing", f"{where}.content")
    out["content"] = "" if content is None else _text(content, f"{where}.content")
    if tool_calls:
        out["tool_calls"] = [_canonical_tool_call(call, f"{where}.tool_calls[{j}]")
                             for j, call in enumerate(_list(tool_calls, f"{where}.tool_calls"))]
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise _bad(f"{where}.tool_call_id must be a string", f"{where}.tool_call_id")
        out["tool_call_id"] = call_id
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    return out


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise _bad(f"{where} must be an array, got {type(value).__name__}", where)
    return value


def _canonical_tool_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if isinstance(arguments, dict):  # some harnesses send the arguments parsed
        arguments = json.dumps(arguments, ensure_ascii=False)
    if not (isinstance(function, dict) and isinstance(function.get("name"), str)
            and isinstance(arguments, str) and isinstance(call.get("id"), str)):
        raise _bad(f"{where} must be {{id, type: 'function', function: {{name, arguments (a JSON string)}}}}", where)
    return {"id": call["id"], "type": "function", "function": {"name": function["name"], "arguments": arguments}}


def _tools(body: dict[str, Any], renders_tools: bool) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    rendered = []
    for j, tool in enumerate(_list(tools, "tools")):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (tool.get("type") == "function" and isinstance(function, dict)
                and isinstance(function.get("name"), str) and function["name"]):
            raise _bad(f"tools[{j}] must be {{type: 'function', function: {{name, description, parameters}}}}",
                       f"tools[{j}]")
        if function.get("strict") not in (None, True, False):
            raise _bad(f"tools[{j}].function.strict must be a boolean", f"tools[{j}].function.strict")
        # `strict` asks for decoding constrained to the schema. Accepted and not enforced: the arguments are
        # what the policy sampled, so that the trainer scores its own tokens. The model never sees it, so
        # neither does the template.
        rendered.append({**tool, "function": {k: v for k, v in function.items() if k != "strict"}})
    if not renders_tools:
        raise _bad("tools: this checkpoint's chat template does not render tools, so the model would never "
                   "see them", "tools")
    return rendered


def _stop_token_ids(body: dict[str, Any], tokenizer: Any) -> tuple[int, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stops, list) and len(stops) <= 4 and all(isinstance(s, str) and s for s in stops)):
        raise _bad("stop must be a non-empty string or an array of at most 4 of them", "stop")
    ids = []
    for s in stops:
        encoded = tokenizer.encode(s, add_special_tokens=False)
        if len(encoded) != 1:
            raise _bad(f"stop: {s!r} is {len(encoded)} tokens of this tokenizer; only stop strings that are one "
                       "token are supported (the trained tokens must be exactly those sampled)", "stop")
        ids.append(encoded[0])
    return tuple(ids)


# Knobs that would change how the policy samples: refused unless left at OpenAI's defaults.
_FIXED = {"n": 1, "frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {}, "top_logprobs": 0}


def parse_chat_request(body: Any, limits: RequestLimits, tokenizer: Any, renders_tools: bool) -> ChatRequest:
    """A ChatRequest from the JSON body; ApiError(400) naming the first bad parameter."""
    if not isinstance(body, dict):
        raise _bad(f"the request body must be a JSON object, got {type(body).__name__}", "body")
    if not isinstance(body.get("model"), str):
        raise _bad("model must be a string", "model")
    messages = _list(body.get("messages"), "messages")
    if not messages:
        raise _bad("messages must not be empty", "messages")
    if len(messages) > limits.max_messages:
        raise _bad(f"messages: {len(messages)} messages, more than gateway.max_messages={limits.max_messages}",
                   "messages")
    for key, default in _FIXED.items():
        if body.get(key) not in (None, default):
            raise _bad(f"{key}={body[key]!r} is not supported: the run's rollout config decides how the policy "
                       "samples", key)
    _number_in(body, "temperature", 0, 2)
    _number_in(body, "top_p", 0, 1, low_open=True)
    max_tokens = _int(body, "max_completion_tokens")
    key = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, key = _int(body, "max_tokens"), "max_tokens"
    if max_tokens is not None and not 1 <= max_tokens <= limits.max_tokens:
        raise _bad(f"{key} must be in [1, {limits.max_tokens}] (rollout.max_tokens_per_turn), got {max_tokens}", key)
    tool_choice = body.get("tool_choice")
    if tool_choice not in (None, "auto", "none"):
        raise _bad(f"tool_choice={tool_choice!r} is not supported (only 'auto' and 'none'): the policy decides",
                   "tool_choice")
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise _bad("response_format: only {'type': 'text'} is supported", "response_format")
    for flag in ("stream", "logprobs"):
        if body.get(flag) not in (None, True, False):
            raise _bad(f"{flag} must be a boolean", flag)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _bad("stream_options must be an object", "stream_options")
    return ChatRequest(
        model=body["model"],
        messages=[canonical_message(m, i) for i, m in enumerate(messages)],
        tools=_tools(body, renders_tools),
        max_tokens=max_tokens,
        stop_token_ids=_stop_token_ids(body, tokenizer),
        parse_tool_calls=tool_choice != "none",
        stream=bool(body.get("stream")),
        include_usage=bool(options.get("include_usage")),
        logprobs=bool(body.get("logprobs")),
    )


def completion_body(completion_id: str, model: str, message: Message, finish_reason: str,
                    usage: dict[str, int], logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    choice = {"index": 0, "message": message, "finish_reason": finish_reason,
              "logprobs": None if logprobs is None else {"content": logprobs}}
    return {"id": completion_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": usage}


def stream_chunk(completion_id: str, model: str, created: int, delta: dict[str, Any], finish_reason: str | None = None,
                 logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One `chat.completion.chunk` of a streamed reply: a delta of its message (role, content
    piece or tool calls), with the logprobs of the tokens it adds when asked for."""
    choice = {"index": 0, "delta": delta, "finish_reason": finish_reason,
              "logprobs": None if logprobs is None else {"content": logprobs}}
    return {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [choice]}


def usage_chunk(completion_id: str, model: str, created: int, usage: dict[str, int]) -> dict[str, Any]:
    """The last chunk of a stream with `stream_options.include_usage`: no choices, the usage."""
    return {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [], "usage": usage}
