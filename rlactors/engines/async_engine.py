"""An asyncio front for an Engine: many concurrent `generate` calls, one background engine loop.

`generate` queues a request and awaits its completion; the loop (a task on the caller's event
loop) adds queued requests between steps and runs each `engine.step()` on a worker thread, so the
event loop keeps accepting calls while the engine computes.

Weight updates come in two phases. The new weights are verified (checksum, names and shapes) beside
the running engine and the call returns; they are loaded later, between steps: after a drain
(in-flight requests finish on the old weights) or at once for a hot swap (in-flight requests go on
with the new weights; each token carries its version). From the return on, nothing new is admitted
until the load, so every request sent after an update returns runs on that version or a newer one.
A version that arrives before the previous one was loaded replaces it (newest wins): the trainer
never waits for a drain, and a replica never loads weights that are already outdated.

If the loop dies (an engine step or a load raised), every pending request and update fails with
EngineDeadError and so does every later call; `stats()["healthy"]` turns False.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import time
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rlactors.config import UpdateMode
from rlactors.engines.base import Engine
from rlactors.types import Completion, SamplingParams
from rlactors.weight_sync.checksum import ChecksumMismatch, state_checksum

logger = logging.getLogger(__name__)

UPDATE_MODES = typing.get_args(UpdateMode)


class EngineDeadError(RuntimeError):
    """The engine loop has died; this generator cannot serve requests any more."""


@dataclass
class _Request:
    request_id: str
    prompt_token_ids: Sequence[int]
    sampling: SamplingParams | Mapping[str, Any]
    future: asyncio.Future
    queued_at: float = field(default_factory=time.perf_counter)
    added_at: float = 0.0


@dataclass
class _Update:
    """Verified weights waiting for a step boundary."""

    version: int
    load: Callable[[], Any]  # runs between engine steps, in the engine thread
    mode: str
    future: asyncio.Future  # the load's timings; cancelled when a newer version replaces it
    queued_at: float = field(default_factory=time.perf_counter)
    held: bool = False  # its receive buffer is being overwritten: not loadable until replaced
    applying: bool = False


class AsyncEngine:
    def __init__(self, engine: Engine, default_update_mode: UpdateMode = "drain"):
        self.engine = engine
        self.default_update_mode = default_update_mode
        self._incoming: list[_Request] = []
        self._in_engine: dict[str, _Request] = {}
        self._aborts: list[str] = []
        self._update: _Update | None = None
        self._receive_lock = asyncio.Lock()  # one incoming version at a time, in order
        self._wake = asyncio.Event()
        self._step_executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        self._side_executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-side")
        self._loop_task: asyncio.Task | None = None
        self._dead: BaseException | None = None
        self._closed = False
        self.counters = {"requests": 0, "completed": 0, "rejected": 0, "updates": 0, "superseded": 0}
        self.busy_s = 0.0  # wall time in engine steps: the replica is generating, not idle
        self.last_update: dict[str, Any] = {}  # timings of the last weights loaded

    @property
    def healthy(self) -> bool:
        return self._dead is None and not self._closed

    # -- calls ------------------------------------------------------------------------------

    async def generate(self, prompt_token_ids: Sequence[int], sampling: SamplingParams | Mapping[str, Any],
                       request_id: str) -> Completion:
        """The completion of one request; ValueError for a bad request (others are unaffected)."""
        self._check_alive()
        request = _Request(request_id, prompt_token_ids, sampling, asyncio.get_running_loop().create_future())
        self._incoming.append(request)
        self.counters["requests"] += 1
        self._kick()
        try:
            return await request.future
        except asyncio.CancelledError:
            self._aborts.append(request_id)
            self._wake.set()
            raise

    async def update_weights(self, version: int, named_tensors: Mapping[str, torch.Tensor],
                             checksum: str | None = None, mode: str | None = None) -> dict[str, Any]:
        """Verifies new weights and queues their load between engine steps; returns once verified.

        With a `checksum`, the received tensors must match it (else ChecksumMismatch); names and
        shapes must match the model (else ValueError). Either way the old weights keep serving.
        """
        mode = self._checked_mode(mode)
        async with self._receive_lock:
            self._check_alive()
            start = time.perf_counter()
            await asyncio.get_running_loop().run_in_executor(
                self._side_executor, self._verify, named_tensors, checksum, version)
            self._check_alive()
            self._queue(_Update(version, functools.partial(self.engine.load_weights, named_tensors, version), mode,
                                asyncio.get_running_loop().create_future()))
            return {"version": version, "mode": mode, "verify_s": time.perf_counter() - start}

    async def receive_weights(self, version: int, checksum: str, mode: str | None = None) -> dict[str, Any]:
        """Weights broadcast by the trainer (NCCL or gloo): received into the engine's
        buffer and verified now, loaded between engine steps later. Returns once verified.

        The buffer holds one version. A version still waiting for its load is overwritten (the new
        one replaces it); a load in progress is waited for. On a checksum mismatch
        ChecksumMismatch is raised and nothing is loaded; if that mismatch overwrote a version
        already accepted, this replica can no longer serve what it promised and its loop dies.
        """
        mode = self._checked_mode(mode)
        async with self._receive_lock:
            self._check_alive()
            overwritten = await self._hold_pending_update()
            self._check_alive()
            try:
                staged = await asyncio.get_running_loop().run_in_executor(
                    self._staging_executor, self.engine.stage_weights, version, checksum)
            except BaseException as e:
                if overwritten is not None:
                    overwritten.load = functools.partial(_raise, e)  # its load kills the loop
                    overwritten.held = False
                    self._kick()
                raise
            self._check_alive()
            self._queue(_Update(version, functools.partial(self.engine.load_staged, version), mode,
                                asyncio.get_running_loop().create_future()))
            return {"version": version, "mode": mode, **staged}

    async def join_weight_group(self, host: str, port: int, rank_offset: int, world_size: int,
                                layout: Any) -> list[int]:
        """Joins a weight broadcast group, in place of any earlier one (rlactors.weight_sync.broadcast).
        Runs between receives, where staging runs; the receive buffer and a version in it that
        waits for its load stay. Returns the ranks taken."""
        async with self._receive_lock:
            self._check_alive()
            return await asyncio.get_running_loop().run_in_executor(
                self._staging_executor, self.engine.join_weight_group, host, port, rank_offset, world_size, layout)

    @property
    def _staging_executor(self) -> concurrent.futures.Executor:
        """Where receives and group joins run: they touch only the receive buffer, so beside the
        engine; an engine that cannot stage while it steps stages between steps, on its thread."""
        return self._side_executor if self.engine.stages_concurrently else self._step_executor

    def _verify(self, named_tensors: Mapping[str, torch.Tensor], checksum: str | None, version: int) -> None:
        if checksum is not None:
            received = state_checksum(named_tensors)
            if received != checksum:
                raise ChecksumMismatch(
                    f"weights for version {version} do not match their checksum (got {received}, "
                    f"expected {checksum}); still serving version {self.engine.version}")
        self.engine.check_weights(named_tensors)

    async def _hold_pending_update(self) -> _Update | None:
        """Keeps the pending update from loading while its buffer is overwritten; returns it. A
        load already running is waited for instead (the buffer is free after it)."""
        update = self._update
        if update is None:
            return None
        if update.applying:
            await asyncio.wait([update.future])
            return None
        update.held = True
        return update

    def _queue(self, update: _Update) -> None:
        """Makes `update` the next load; a pending one that has not started loading is dropped."""
        pending = self._update
        if pending is not None and not pending.applying:
            pending.future.cancel()
            self.counters["superseded"] += 1
        update.future.add_done_callback(self._loaded)
        self._update = update
        self._kick()

    def _loaded(self, future: asyncio.Future) -> None:
        if not future.cancelled() and future.exception() is None:
            self.counters["updates"] += 1
            self.last_update = future.result()

    def _checked_mode(self, mode: str | None) -> str:
        mode = mode or self.default_update_mode
        if mode not in UPDATE_MODES:
            raise ValueError(f"update mode must be one of {UPDATE_MODES}, got {mode!r}")
        if mode == "hot_swap" and not self.engine.hot_swaps:
            raise ValueError("this engine loads weights between requests only (started for "
                             "generator.update_mode = 'drain'): it cannot hot swap")
        return mode

    def stats(self) -> dict[str, Any]:
        return {
            "healthy": self.healthy,
            "error": None if self._dead is None else repr(self._dead),
            "in_flight": len(self._incoming) + len(self._in_engine),
            "updating": self._update is not None,
            "busy_s": self.busy_s,
            "last_update": self.last_update,
            **self.counters,
            **self.engine.stats(),
        }

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
        # A receive waits for its sender, which may be gone (the trainer died; NCCL waits for
        # ever): do not wait for it; the proc is stopped next.
        self._side_executor.shutdown(wait=False, cancel_futures=True)

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
            update = self._update
            if (update is not None and not update.held
                    and (update.mode == "hot_swap" or not self.engine.has_unfinished())):
                await self._apply_update(update)
            if self._update is None:  # verified weights wait for their load: admit nothing meanwhile
                self._admit()
            if self.engine.has_unfinished():
                start = time.perf_counter()
                completions = await loop.run_in_executor(self._step_executor, self.engine.step)
                self.busy_s += time.perf_counter() - start
                for completion in completions:
                    self._finish(completion)
            elif self._closed:
                return
            elif self._update is None or self._update.held:
                await self._wake.wait()  # nothing to step and nothing to load
                self._wake.clear()

    def _admit(self) -> None:
        incoming, self._incoming = self._incoming, []
        for request in incoming:
            if request.future.done():
                continue  # cancelled by its caller before reaching the engine
            try:
                self.engine.add_request(request.request_id, request.prompt_token_ids, request.sampling)
            except ValueError as e:
                self.counters["rejected"] += 1
                request.future.set_exception(e)
                continue
            request.added_at = time.perf_counter()
            self._in_engine[request.request_id] = request

    def _apply_aborts(self) -> None:
        aborts, self._aborts = self._aborts, []
        for request_id in aborts:
            self.engine.abort(request_id)

    async def _apply_update(self, update: _Update) -> None:
        loop = asyncio.get_running_loop()
        waited = time.perf_counter() - update.queued_at
        start = time.perf_counter()
        update.applying = True
        try:
            engine_timings = await loop.run_in_executor(self._step_executor, update.load)
        except BaseException as e:
            # The weights were verified: a load that fails leaves the model half-written, and
            # this replica must not serve it.
            update.future.set_exception(EngineDeadError(f"loading weights version {update.version} failed: {e!r}"))
            raise
        else:
            update.future.set_result({"version": update.version, "wait_s": waited,
                                      "apply_s": time.perf_counter() - start, **(engine_timings or {})})
        finally:
            if self._update is update:
                self._update = None

    def _finish(self, completion: Completion) -> None:
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
        self._incoming, self._in_engine = [], {}
        for request in pending:
            if not request.future.done():
                request.future.set_exception(error)
        if self._update is not None and not self._update.future.done():
            self._update.future.set_exception(error)
        self._update = None


def _raise(error: BaseException) -> None:
    raise error
