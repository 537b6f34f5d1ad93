"""The gateway: an OpenAI Chat Completions server whose sessions are rollouts.

Each rollout of an AgentEnv gets a session with an unguessable id and the URL
`http://HOST:PORT/sessions/<id>/v1`; every chat request the harness sends there is one turn of
that rollout, sampled through the rollout's `model` (the Rollouter's limits, seeds and sticky
routing, through the GeneratorRouter). The gateway runs in the controller's event loop, beside the
Rollouter that owns the rollouts, bound to 127.0.0.1 unless `gateway.host` says otherwise; every
request must carry the run's random API key. Bad requests get OpenAI-style 4xx JSON errors and
change nothing: no session, turn or run state. A request's body is at most
`gateway.max_request_bytes` (413 beyond); a prompt that renders more than INLINE_RENDER_CHARS of
text is rendered and tokenized on one of `gateway.render_threads` threads, so that other sessions'
turns go on meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import logging
import random
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from rlactors.config import GatewayConfig
from rlactors.gateway.protocol import (
    ApiError,
    ChatRequest,
    RequestLimits,
    canonical_message,
    completion_body,
    parse_chat_request,
    stream_chunk,
    usage_chunk,
)
from rlactors.gateway.sessions import TokenHistory
from rlactors.gateway.streaming import ContentStream, StreamMismatch
from rlactors.gateway.tool_calls import parse_tool_calls
from rlactors.models.tokenizer import render_text
from rlactors.rollout.env import ModelTurns, TurnRefused
from rlactors.rollout.types import Turn
from rlactors.types import TokenDelta

logger = logging.getLogger(__name__)

COUNTERS = ("requests", "branches", "tool_calls", "unparsable_tool_calls", "client_errors")
# Tokenizing costs ~1-10 us a character (the more the busier the machine): up to this much new
# text (a tool's result, a user turn) renders on the event loop, in a few ms at most; more (a long
# history rendered whole: seconds at a few MB) on the render threads.
INLINE_RENDER_CHARS = 2048


_REPLY_IDS = random.Random()  # seeded from the OS once; its own, so a harness seeding `random` repeats none


def completion_id() -> str:
    """A reply's `id`: unique, not secret (only session ids and the API key are), so not drawn from
    the OS's entropy with a system call per reply."""
    return f"chatcmpl-{_REPLY_IDS.getrandbits(96):024x}"


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
        self._authorization = f"Bearer {self.api_key}".encode()  # the header every request must carry
        self.port: int | None = None
        self.counters: Counter[str] = Counter()
        self._reported: Counter[str] = Counter()
        self._sessions: dict[str, _Session] = {}
        self._renders_tools = renders_tools(tokenizer)
        self._render_pool: ThreadPoolExecutor | None = None  # while started
        self._runner: web.AppRunner | None = None
        self._tls: Any = None  # the TLS context of every session's client (unused on http://, built all the same)
        self._gc_threshold: tuple[int, ...] = ()  # the collector's, before start

    async def start(self) -> None:
        try:  # loaded now, for the sessions' clients, so that the freeze below holds them
            import httpx
            import openai  # noqa: F401
        except ImportError as e:
            raise ImportError(f"the gateway hands each session an `openai` client: pip install 'rlactors[agents]' "
                              f"({e})") from e

        self._tls = httpx.create_ssl_context()
        # Each turn leaves a few hundred container objects behind for a while (HTTP on both ends,
        # messages, token lists), which kept Python's collector busy: a young collection every
        # couple of turns, and every few hundred turns one that walks the whole heap (torch,
        # transformers, Monarch, the clients), a cost of the same order as the gateway's own per
        # turn (benchmarks/results/notes/gateway_overhead.md). What exists now lives as long as the
        # process: frozen, collections skip it; and young collections wait for 20,000 new objects
        # instead of 700. `stop` undoes both.
        gc.collect()
        gc.freeze()
        self._gc_threshold = gc.get_threshold()
        gc.set_threshold(20_000, *self._gc_threshold[1:])
        self._render_pool = ThreadPoolExecutor(self.config.render_threads, thread_name_prefix="gateway-render")
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
            self._render_pool.shutdown(wait=False, cancel_futures=True)
            gc.set_threshold(*self._gc_threshold)
            gc.unfreeze()

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
        if not hmac.compare_digest(given.encode(), self._authorization):
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
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}", "body") from None
        chat = parse_chat_request(body, self.limits, self.tokenizer, self._renders_tools)
        self.counters["requests"] += 1
        stream = _SseReply(request, chat, self.tokenizer, self._token_logprob) if chat.stream else None
        try:
            return await self._answer(session, chat, stream)
        except Exception as e:
            if stream is None or not stream.started:
                raise  # answered as JSON by _errors
            logger.exception("gateway stream failed")  # a bug: the headers are out, the stream ends with the error
            return await stream.fail(ApiError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error"))

    async def _answer(self, session: _Session, chat: ChatRequest, stream: _SseReply | None) -> web.StreamResponse:
        """One turn of the session: its reply as JSON, or streamed (`stream`)."""
        async with session.lock:
            history = session.history
            new = history.extension(chat.messages, chat.tools)
            rendered = history.render_chars(*((chat.messages, chat.tools) if new is None else (new, None)))
            try:
                if rendered > INLINE_RENDER_CHARS:
                    prompt = await asyncio.get_running_loop().run_in_executor(
                        self._render_pool, history.prompt, chat.messages, chat.tools, new)
                else:
                    prompt = history.prompt(chat.messages, chat.tools, new)
            except Exception as e:  # noqa: BLE001 - the template's error is the client's message
                raise ApiError(400, f"messages: the chat template cannot render them: {e}", "messages") from None
            if history.messages is not None and new is None:
                self.counters["branches"] += 1
            try:
                turn = await session.model(prompt, chat.max_tokens, chat.stop_token_ids,
                                           on_tokens=None if stream is None else stream.tokens)
            except TurnRefused as e:
                error = ApiError(500, f"the generator failed: {e}", kind="server_error") if e.status.is_error \
                    else ApiError(400, f"the rollout takes no more turns: {e}", code=e.status.value)
                if stream is None or not stream.started:
                    raise error from None
                return await stream.fail(error)  # the client has tokens already: the stream ends with the error
            reply, finish_reason, logprobs = self._reply(chat, turn)
            history.record(chat.messages, chat.tools, new, prompt, turn.token_ids, canonical_message(reply, 0))
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(turn.token_ids),
                 "total_tokens": len(prompt) + len(turn.token_ids)}
        if stream is not None:
            return await stream.finish(reply, finish_reason, usage)
        return web.Response(body=orjson.dumps(completion_body(completion_id(), chat.model, reply,
                                                              finish_reason, usage, logprobs)),
                            content_type="application/json")

    def _reply(self, chat: ChatRequest, turn: Turn) -> tuple[dict[str, Any], str, list[dict[str, Any]] | None]:
        """The assistant message, its finish reason, and its tokens' logprob entries when asked
        for (unstreamed: a stream sends its own as the tokens come)."""
        text = self.tokenizer.decode(turn.token_ids, skip_special_tokens=True)
        parsed = parse_tool_calls(text) if chat.parse_tool_calls and chat.tools else None
        if parsed is not None and parsed.unparsable:
            self.counters["unparsable_tool_calls"] += 1
        tool_calls = parsed.tool_calls if parsed is not None else []
        self.counters["tool_calls"] += len(tool_calls)
        logprobs = [self._token_logprob(t, lp) for t, lp in zip(turn.token_ids, turn.logprobs)] \
            if chat.logprobs and not chat.stream else None
        # A turn cut by max_tokens is "length" even when the calls it holds are whole (as OpenAI
        # answers): the harness learns that the reply was cut.
        cut = turn.finish_reason == "length"
        if tool_calls:
            return {"role": "assistant", "content": parsed.content or None, "tool_calls": tool_calls}, \
                "length" if cut else "tool_calls", logprobs
        return {"role": "assistant", "content": text}, "length" if cut else "stop", logprobs

    def _token_logprob(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self.tokenizer.decode([token_id])
        return {"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []}


_CLIENT_GONE = (ConnectionError, RuntimeError)  # aiohttp's RuntimeError: the client's transport closed


class _SseReply:
    """A streamed reply as server-sent events: the role and content pieces as the tokens come
    (`tokens`, a turn's on_tokens), then the rest, the tool calls, the finish reason and the usage
    (`finish`), or an error event (`fail`). The response starts with the first tokens; a client
    that went away is no longer written to, and its turn is recorded all the same."""

    def __init__(self, request: web.Request, chat: ChatRequest, tokenizer: Any, token_logprob: Any) -> None:
        self.request, self.chat = request, chat
        self.content = ContentStream(tokenizer, bool(chat.tools) and chat.parse_tool_calls,
                                     token_logprob if chat.logprobs else None)
        self.response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        self.id, self.created = completion_id(), int(time.time())
        self.started = False
        self.gone = False

    async def tokens(self, delta: TokenDelta) -> None:
        piece = self.content.feed(delta.token_ids, delta.logprobs)
        await self._start()  # with the first token, even when its text is held back
        if piece is not None:
            await self._chunk({"content": piece[0]}, logprobs=piece[1])

    async def finish(self, reply: dict[str, Any], finish_reason: str, usage: dict[str, int]) -> web.StreamResponse:
        try:
            rest, logprobs = self.content.finish(reply["content"] or "")
        except StreamMismatch as e:
            logger.error("gateway stream: %s", e)
            return await self.fail(ApiError(500, str(e), kind="server_error"))
        await self._start()
        if rest or logprobs:
            await self._chunk({"content": rest}, logprobs=logprobs)
        for j, call in enumerate(reply.get("tool_calls", ())):
            await self._chunk({"tool_calls": [{"index": j, **call}]})
        await self._chunk({}, finish_reason)
        if self.chat.include_usage:
            await self._write(usage_chunk(self.id, self.chat.model, self.created, usage))
        return await self._done()

    async def fail(self, error: ApiError) -> web.StreamResponse:
        await self._start()
        await self._write(error.body())
        return await self._done()

    async def _start(self) -> None:
        if not self.started:
            self.started = True
            try:
                await self.response.prepare(self.request)
            except _CLIENT_GONE:
                self.gone = True
            await self._chunk({"role": "assistant", "content": ""})

    async def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None, logprobs: Any = None) -> None:
        await self._write(stream_chunk(self.id, self.chat.model, self.created, delta, finish_reason, logprobs))

    async def _write(self, event: Any) -> None:
        await self._send(b"data: " + orjson.dumps(event) + b"\n\n")

    async def _send(self, data: bytes) -> None:
        if self.gone:
            return
        try:
            await self.response.write(data)
        except _CLIENT_GONE:
            self.gone = True

    async def _done(self) -> web.StreamResponse:
        await self._send(b"data: [DONE]\n\n")
        if not self.gone:
            with contextlib.suppress(*_CLIENT_GONE):
                await self.response.write_eof()
        return self.response
