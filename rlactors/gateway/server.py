"""The gateway: an OpenAI Chat Completions server whose sessions are rollouts.

Each rollout of an AgentEnv gets a session with an unguessable id and the URL
`http://HOST:PORT/sessions/<id>/v1`; every chat request the harness sends there is one turn of
that rollout, sampled through the rollout's `model` (the Rollouter's limits, seeds and sticky
routing, through the GeneratorRouter). The gateway runs in the controller's event loop, beside the
Rollouter that owns the rollouts, bound to 127.0.0.1 unless `gateway.host` says otherwise; every
request must carry the run's random API key. Bad requests get OpenAI-style 4xx JSON errors and
change nothing: no session, turn or run state.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import secrets
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from rlactors.config import GatewayConfig
from rlactors.gateway.protocol import (
    ApiError,
    ChatRequest,
    RequestLimits,
    canonical_message,
    completion_body,
    parse_chat_request,
    stream_chunks,
)
from rlactors.gateway.sessions import TokenHistory
from rlactors.gateway.tool_calls import parse_tool_calls
from rlactors.models.tokenizer import render_text
from rlactors.rollout.env import ModelTurns, TurnRefused
from rlactors.rollout.types import Turn

logger = logging.getLogger(__name__)

COUNTERS = ("requests", "branches", "tool_calls", "unparsable_tool_calls", "client_errors")


@dataclass(frozen=True)
class SessionInfo:
    """Where a harness reaches its session: an OpenAI `base_url` and the run's API key."""

    session_id: str
    base_url: str
    api_key: str


class _Session:
    def __init__(self, model: ModelTurns, tokenizer: Any) -> None:
        self.model = model
        self.history = TokenHistory(tokenizer)
        self.lock = asyncio.Lock()  # one turn at a time: a session's turns form one history


def renders_tools(tokenizer: Any) -> bool:
    """Whether the chat template shows `tools` to the model at all."""
    messages = [{"role": "user", "content": "x"}]
    tool = {"type": "function", "function": {"name": "rlactors_probe", "description": "", "parameters": {}}}
    return render_text(tokenizer, messages, True, [tool]) != render_text(tokenizer, messages, True)


class Gateway:
    """`await start()`, then `async with gateway.session(model) as info:` per rollout; `await stop()`."""

    def __init__(self, config: GatewayConfig, tokenizer: Any, max_tokens: int) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.limits = RequestLimits(max_messages=config.max_messages, max_tokens=max_tokens)
        self.api_key = f"rla-{secrets.token_urlsafe(32)}"
        self.port: int | None = None
        self.counters: Counter[str] = Counter()
        self._reported: Counter[str] = Counter()
        self._sessions: dict[str, _Session] = {}
        self._renders_tools = renders_tools(tokenizer)
        self._runner: web.AppRunner | None = None
        self._tls: Any = None  # the TLS context of every session's client (unused on http://, built all the same)

    async def start(self) -> None:
        app = web.Application(client_max_size=self.config.max_request_bytes, middlewares=[self._errors, self._auth])
        app.router.add_post("/sessions/{session}/v1/chat/completions", self._chat)
        app.router.add_get("/sessions/{session}/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "") else self.config.host
        return f"http://{host}:{self.port}"

    @contextlib.asynccontextmanager
    async def session(self, model: ModelTurns) -> AsyncIterator[SessionInfo]:
        """A session whose turns are sampled by `model`, open while the block runs."""
        if self.port is None:
            raise RuntimeError("the gateway is not started")
        session_id = secrets.token_urlsafe(16)
        self._sessions[session_id] = _Session(model, self.tokenizer)
        try:
            yield SessionInfo(session_id, f"{self.url}/sessions/{session_id}/v1", self.api_key)
        finally:
            del self._sessions[session_id]

    @contextlib.asynccontextmanager
    async def client(self, session: SessionInfo) -> AsyncIterator[Any]:
        """An `openai.AsyncOpenAI` for `session`, open while the block runs: its own small
        connection pool (one pool for every session would scan all its connections on each
        request), sharing the gateway's TLS context (loading one costs ~20 ms a client). It never
        retries (a failed turn is the rollout's to handle), never times out (rollout.step_timeout_s
        and the generator's own limits bound a turn), and ignores proxy settings in the environment
        (the gateway is reached directly; reading them cost a fifth of each client's setup)."""
        import httpx
        from openai import AsyncOpenAI

        if self._tls is None:
            self._tls = httpx.create_ssl_context()
        async with httpx.AsyncClient(verify=self._tls, timeout=None, trust_env=False) as http:
            yield AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0, http_client=http)

    def step_metrics(self) -> dict[str, float]:
        """`gateway/<counter>` since the last call (a training step's worth)."""
        metrics = {f"gateway/{name}": float(self.counters[name] - self._reported[name]) for name in COUNTERS}
        self._reported = Counter(self.counters)
        return metrics

    # -- HTTP ---------------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as e:
            error = e
        except web.HTTPException as e:  # aiohttp's own: unknown path, wrong method, body too large
            error = ApiError(e.status, e.reason if e.status != 413 else
                             f"the request body exceeds gateway.max_request_bytes={self.config.max_request_bytes}",
                             kind="invalid_request_error" if e.status < 500 else "server_error")
        except Exception as e:  # noqa: BLE001 - a bug answers this request with a 500, the gateway serves on
            logger.exception("gateway request failed")
            error = ApiError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error")
        if error.status < 500:
            self.counters["client_errors"] += 1
        return web.json_response(error.body(), status=error.status)

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise ApiError(401, "Incorrect API key provided: use the key this run gave its harness",
                           code="invalid_api_key", kind="authentication_error")
        return await handler(request)

    def _session(self, request: web.Request) -> _Session:
        session = self._sessions.get(request.match_info["session"])
        if session is None:
            raise ApiError(404, "no such session (it ended with its rollout, or never existed)",
                           code="session_not_found")
        return session

    async def _models(self, request: web.Request) -> web.Response:
        self._session(request)
        return web.json_response({"object": "list", "data": [{"id": "rlactors-policy", "object": "model",
                                                              "created": 0, "owned_by": "rlactors"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request)
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}", "body") from None
        chat = parse_chat_request(body, self.limits, self.tokenizer, self._renders_tools)
        self.counters["requests"] += 1
        async with session.lock:
            try:
                prompt, extends = session.history.prompt_for(chat.messages, chat.tools)
            except Exception as e:  # noqa: BLE001 - the template's error is the client's message
                raise ApiError(400, f"messages: the chat template cannot render them: {e}", "messages") from None
            if session.history.messages is not None and not extends:
                self.counters["branches"] += 1
            try:
                turn = await session.model(prompt, chat.max_tokens, chat.stop_token_ids)
            except TurnRefused as e:
                raise (ApiError(500, f"the generator failed: {e}", kind="server_error") if e.status.is_error else
                       ApiError(400, f"the rollout takes no more turns: {e}", code=e.status.value)) from None
            reply, finish_reason, pieces = self._reply(chat, turn)
            session.history.record(chat.messages, chat.tools, prompt, turn.token_ids, canonical_message(reply, 0))
        completion_id = f"chatcmpl-{secrets.token_hex(12)}"
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(turn.token_ids),
                 "total_tokens": len(prompt) + len(turn.token_ids)}
        if not chat.stream:
            logprobs = [lp for _, lps in pieces for lp in lps or ()] if chat.logprobs else None
            return web.json_response(completion_body(completion_id, chat.model, reply, finish_reason, usage, logprobs))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        for chunk in stream_chunks(completion_id, chat.model, reply, finish_reason, usage, pieces, chat.include_usage):
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def _reply(self, chat: ChatRequest, turn: Turn) -> tuple[dict[str, Any], str, list[tuple[str, Any]]]:
        """The assistant message, its finish reason, and its content in pieces (per token when
        streamed, unless it holds tool calls), each with its tokens' logprobs when asked for."""
        text = self.tokenizer.decode(turn.token_ids, skip_special_tokens=True)
        parsed = parse_tool_calls(text) if chat.parse_tool_calls and chat.tools else None
        if parsed is not None and parsed.unparsable:
            self.counters["unparsable_tool_calls"] += 1
        tool_calls = parsed.tool_calls if parsed is not None else []
        self.counters["tool_calls"] += len(tool_calls)
        logprobs = [self._token_logprob(t, lp) for t, lp in zip(turn.token_ids, turn.logprobs)] \
            if chat.logprobs else None
        if tool_calls:
            reply = {"role": "assistant", "content": parsed.content or None, "tool_calls": tool_calls}
            return reply, "tool_calls", [(parsed.content, logprobs)]
        finish_reason = "length" if turn.finish_reason == "length" else "stop"
        pieces = self._pieces(turn.token_ids, logprobs) if chat.stream else [(text, logprobs)]
        return {"role": "assistant", "content": text}, finish_reason, pieces

    def _pieces(self, token_ids: list[int], logprobs: list[dict[str, Any]] | None) -> list[tuple[str, Any]]:
        """One piece of text per token: what decoding up to it adds (a character split across tokens
        comes with its last one)."""
        pieces, emitted = [], ""
        for i in range(len(token_ids)):
            text = self.tokenizer.decode(token_ids[:i + 1], skip_special_tokens=True)
            piece = ""
            if text.startswith(emitted) and not text.endswith("\ufffd"):
                piece, emitted = text[len(emitted):], text
            pieces.append((piece, None if logprobs is None else [logprobs[i]]))
        whole = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        if pieces and whole != emitted:  # the text ends in an incomplete character: as decoded
            pieces[-1] = (pieces[-1][0] + whole[len(emitted):], pieces[-1][1])
        return pieces

    def _token_logprob(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self.tokenizer.decode([token_id])
        return {"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []}
