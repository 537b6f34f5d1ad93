"""An asyncio front for an Engine: many concurrent `generate` calls, one background engine loop.

`generate` queues a request and awaits its completion; the loop (a task on the caller's event
loop) adds queued requests between steps and runs each `engine.step()` on a worker thread, so the
event loop keeps accepting calls while the engine computes. A streamed request (`on_tokens`) is
told its new tokens after every step (`Engine.sampled`).

Weight updates (`updates`, rlactors.weight_sync.updates) are verified beside the running engine;
the loop loads them between steps, and admits no new request while verified weights wait for
their load.

If the loop dies (an engine step or a load raised), every pending request and update fails with
EngineDeadError and so does every later call; `stats()["healthy"]` turns False.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlactors.config import UpdateMode
from rlactors.engines.base import Engine
from rlactors.types import Completion, EngineDeadError, SamplingParams, TokenDelta
from rlactors.weight_sync.updates import WeightUpdates

logger = logging.getLogger(__name__)


@dataclass
class _Request:
    request_id: str
    prompt_token_ids: Sequence[int]
    sampling: SamplingParams | Mapping[str, Any]
    future: asyncio.Future
    on_tokens: Callable[[TokenDelta], None] | None = None  # streamed: told each step's new tokens
    streamed: int = 0  # tokens told to on_tokens so far
    queued_at: float = field(default_factory=time.perf_counter)
    added_at: float = 0.0


class AsyncEngine:
    def __init__(self, engine: Engine, default_update_mode: UpdateMode = "drain"):
        self.engine = engine
        self._incoming: list[_Request] = []
        self._in_engine: dict[str, _Request] = {}
        self._streamed: dict[str, _Request] = {}  # those of _in_engine with on_tokens
        self._aborts: list[str] = []
        self._wake = asyncio.Event()
        self._step_executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        self.updates = WeightUpdates(engine, default_update_mode, self._step_executor, self._check_alive, self._kick)
        self._loop_task: asyncio.Task | None = None
        self._dead: BaseException | None = None
        self._closed = False
        self.counters = {"requests": 0, "completed": 0, "rejected": 0}
        self.busy_s = 0.0  # wall time in engine steps: the replica is generating, not idle

    @property
    def healthy(self) -> bool:
        return self._dead is None and not self._closed

    # -- calls ------------------------------------------------------------------------------

    async def generate(self, prompt_token_ids: Sequence[int], sampling: SamplingParams | Mapping[str, Any],
                       request_id: str, on_tokens: Callable[[TokenDelta], None] | None = None) -> Completion:
        """The completion of one request; ValueError for a bad request (others are unaffected).
        Given `on_tokens`, it is called after each engine step that sampled tokens for the request
        (but not its last: those come with the completion)."""
        self._check_alive()
        request = _Request(request_id, prompt_token_ids, sampling, asyncio.get_running_loop().create_future(),
                           on_tokens)
        self._incoming.append(request)
        self.counters["requests"] += 1
        self._kick()
        try:
            return await request.future
        except asyncio.CancelledError:
            self._aborts.append(request_id)
            self._wake.set()
            raise

    def stats(self) -> dict[str, Any]:
        return {
            "healthy": self.healthy,
            "error": None if self._dead is None else repr(self._dead),
            "in_flight": len(self._incoming) + len(self._in_engine),
            "updating": self.updates.waiting,
            "busy_s": self.busy_s,
            "last_update": self.updates.last_update,
            **self.counters,
            **self.updates.counters,
            **self.engine.stats(),
        }

    async def sleep(self) -> None:
        """The engine sleeps (`Engine.sleep`) between its steps; RuntimeError, and no sleep, while
        a request is in flight: asleep it could not serve it."""
        self._check_alive()
        in_flight = len(self._incoming) + len(self._in_engine)
        if in_flight:
            raise RuntimeError(f"cannot sleep with {in_flight} request(s) in flight")
        await asyncio.get_running_loop().run_in_executor(self._step_executor, self.engine.sleep)

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Takes back what `sleep` freed (`Engine.wake_up`), between the engine's steps, once
        weights verified before it are loaded: a weight sync between a wake of the weights and
        one of the KV cache lands before the cache is allocated again."""
        self._check_alive()
        pending = self.updates.pending
        if pending is not None and not pending.held:
            await asyncio.wait([pending.future])
        self._check_alive()
        await asyncio.get_running_loop().run_in_executor(self._step_executor, self.engine.wake_up, tags)

    async def close(self) -> None:
        """Aborts what is in flight (those calls return finish_reason "abort") and stops the loop."""
        if self._closed:
            return
        self._closed = True
        for request in self._incoming:
            self._resolve(request, self._aborted(request))
        self._incoming.clear()
        self._aborts.extend(self._in_engine)
        self._wake.set()
        if self._loop_task is not None:
            await asyncio.gather(self._loop_task, return_exceptions=True)
        self.engine.close()
        self._step_executor.shutdown(wait=True)
        self.updates.close()

    # -- the loop ---------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"generator engine loop died: {self._dead!r}")
        if self._closed:
            raise EngineDeadError("generator is closed")

    def _kick(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._run())
        self._wake.set()

    async def _run(self) -> None:
        try:
            await self._serve()
        except BaseException as e:  # noqa: B036 - any death must fail the pending calls
            if not isinstance(e, asyncio.CancelledError):
                logger.exception("generator engine loop died")
            self._dead = e
            self._fail_all(EngineDeadError(f"generator engine loop died: {e!r}"))
            raise

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._apply_aborts()
            update = self.updates.due(busy=self.engine.has_unfinished())
            if update is not None:
                await self.updates.load(update)
            if not self.updates.waiting:  # verified weights wait for their load: admit nothing meanwhile
                self._admit()
            if self.engine.has_unfinished():
                start = time.perf_counter()
                completions = await loop.run_in_executor(self._step_executor, self.engine.step)
                self.busy_s += time.perf_counter() - start
                for completion in completions:
                    self._finish(completion)
                self._stream()
            elif self._closed:
                return
            elif not self.updates.loadable:
                await self._wake.wait()  # nothing to step and nothing to load
                self._wake.clear()

    def _admit(self) -> None:
        incoming, self._incoming = self._incoming, []
        for request in incoming:
            if request.future.done():
                continue  # cancelled by its caller before reaching the engine
            try:
                self.engine.add_request(request.request_id, request.prompt_token_ids, request.sampling,
                                        streamed=request.on_tokens is not None)
            except ValueError as e:
                self.counters["rejected"] += 1
                request.future.set_exception(e)
                continue
            request.added_at = time.perf_counter()
            self._in_engine[request.request_id] = request
            if request.on_tokens is not None:
                self._streamed[request.request_id] = request

    def _apply_aborts(self) -> None:
        aborts, self._aborts = self._aborts, []
        for request_id in aborts:
            self.engine.abort(request_id)

    def _stream(self) -> None:
        for request in list(self._streamed.values()):
            delta = self.engine.sampled(request.request_id, request.streamed)
            if delta is None or not delta.token_ids:
                continue
            request.streamed = delta.end
            try:
                request.on_tokens(delta)
            except Exception:  # noqa: BLE001 - one listener's failure must not stop the engine loop
                logger.exception("streaming the tokens of request %r failed; it completes unstreamed",
                                 request.request_id)
                del self._streamed[request.request_id]

    def _finish(self, completion: Completion) -> None:
        self._streamed.pop(completion.request_id, None)
        request = self._in_engine.pop(completion.request_id, None)
        if request is None:
            return
        completion.timings["queue_s"] += request.added_at - request.queued_at
        self.counters["completed"] += 1
        self._resolve(request, completion)

    @staticmethod
    def _resolve(request: _Request, completion: Completion) -> None:
        if not request.future.done():
            request.future.set_result(completion)

    @staticmethod
    def _aborted(request: _Request) -> Completion:
        return Completion(request.request_id, list(request.prompt_token_ids), [], [], [], "abort")

    def _fail_all(self, error: EngineDeadError) -> None:
        pending = self._incoming + list(self._in_engine.values())
        self._incoming, self._in_engine, self._streamed = [], {}, {}
        for request in pending:
            if not request.future.done():
                request.future.set_exception(error)
        self.updates.fail(error)
