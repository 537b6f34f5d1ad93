"""Streaming a completion's tokens as they are sampled, exactly, across replica failures.

A streamed request's tokens travel as TokenDeltas, generator -> router -> caller, over Monarch
ports beside the generate call whose result (the Completion) holds them all. A port's messages
keep their order, but not their order with the call's result: each side keeps a `TokenCursor`,
which passes on only the tokens after those it passed already, and the completion's tail once the
call returns. So the tokens a caller is told are always a prefix of the completion it gets.

When the replica dies mid-stream, the router continues on another one from the prompt + the
tokens it already passed on (`StreamedAttempts`): those keep their logprobs and policy versions,
and the completion is them + the continuation.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from rlactors.types import Completion, SamplingParams, TokenDelta


class TokenCursor:
    """The tokens of one completion passed on so far, from deltas that may repeat or overlap."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []

    @property
    def count(self) -> int:
        return len(self.token_ids)

    def advance(self, delta: TokenDelta, offset: int = 0) -> TokenDelta | None:
        """The part of `delta` (its tokens counted from `offset`) after the tokens passed on, now
        passed on too; None when it adds nothing or leaves a gap (its tokens come later)."""
        start = offset + delta.start
        if start > self.count or offset + delta.end <= self.count:
            return None
        skip = self.count - start
        new = TokenDelta(self.count, delta.token_ids[skip:], delta.logprobs[skip:], delta.versions[skip:])
        self.token_ids += new.token_ids
        self.logprobs += new.logprobs
        self.versions += new.versions
        return new

    def tail(self, completion: Completion, offset: int = 0) -> TokenDelta | None:
        """`advance` by the whole completion (its tokens counted from `offset`)."""
        return self.advance(TokenDelta(0, completion.token_ids, completion.logprobs, completion.versions), offset)


class StreamedAttempts:
    """The router's side of one streamed request: what each attempt asks for, and the completion.

    The first attempt asks for the request as given. After a failed attempt, the next one asks
    for the continuation of the prompt + the tokens passed on (`passed`), for the tokens left of
    max_tokens; when those tokens already end the completion (a stop token, or max_tokens of
    them) there is nothing to ask (`next_request` is None) and `ended` is the completion.
    """

    def __init__(self, prompt_token_ids: Sequence[int], sampling: SamplingParams) -> None:
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling = sampling
        self.passed = TokenCursor()
        self.offset = 0  # tokens passed on before the current attempt: its token 0 is completion token `offset`

    def next_request(self) -> tuple[list[int], SamplingParams] | None:
        """The prompt and sampling of the next attempt; None when the passed tokens end the completion."""
        self.offset = self.passed.count
        if self._finish_reason() is not None:
            return None
        if not self.offset:
            return self.prompt_token_ids, self.sampling
        return (self.prompt_token_ids + self.passed.token_ids,
                dataclasses.replace(self.sampling, max_tokens=self.sampling.max_tokens - self.offset))

    def forward(self, delta: TokenDelta) -> TokenDelta | None:
        """A delta of the current attempt, as the caller gets it: counted from the completion's start."""
        return self.passed.advance(delta, self.offset)

    def completed(self, completion: Completion) -> Completion:
        """The request's completion, given the current attempt's."""
        if not self.offset:
            return completion
        return dataclasses.replace(
            completion, prompt_token_ids=self.prompt_token_ids,
            token_ids=self.passed.token_ids[:self.offset] + completion.token_ids,
            logprobs=self.passed.logprobs[:self.offset] + completion.logprobs,
            versions=self.passed.versions[:self.offset] + completion.versions,
            routed_experts=None)  # not kept for the passed tokens

    def ended(self, request_id: str) -> Completion:
        """The completion when the passed tokens end it (`next_request` was None)."""
        reason = self._finish_reason()
        assert reason is not None
        return Completion(request_id, self.prompt_token_ids, list(self.passed.token_ids), list(self.passed.logprobs),
                          list(self.passed.versions), reason)

    def _finish_reason(self) -> str | None:
        if self.passed.token_ids and self.passed.token_ids[-1] in self.sampling.stop_token_ids:
            return "stop"
        if self.passed.count >= self.sampling.max_tokens:
            return "length"
        return None


async def stream_tokens(call: Callable[[Any], Awaitable[Completion]],
                        on_tokens: Callable[[TokenDelta], Awaitable[None]]) -> Completion:
    """The completion of `call(port)`, a streamed generate call that sends TokenDeltas to `port`;
    `on_tokens` is awaited with each delta's new tokens as they come, then with the completion's
    tail (the tokens no delta brought before it returned)."""
    from monarch.actor import Channel

    port, receiver = Channel.open()
    cursor = TokenCursor()
    result = asyncio.ensure_future(call(port))
    received: asyncio.Future | None = None
    try:
        while not result.done():
            if received is None:
                received = asyncio.ensure_future(receiver.recv())
            await asyncio.wait({received, result}, return_when=asyncio.FIRST_COMPLETED)
            if received.done():
                delta, received = cursor.advance(received.result()), None
                if delta is not None:
                    await on_tokens(delta)
        completion = result.result()
    finally:
        for pending in (received, result):
            if pending is not None and not pending.done():
                pending.cancel()
    tail = cursor.tail(completion)
    if tail is not None:
        await on_tokens(tail)
    return completion
