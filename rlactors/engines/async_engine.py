"""An asyncio front for an Engine: many concurrent `generate` calls, one background engine loop.

`generate` queues a request and awaits its completion; the loop (a task on the caller's event
loop) adds queued requests between steps and runs each `engine.step()` on a worker thread, so the
event loop keeps accepting calls while the engine computes. Weight updates are applied between
steps: `drain` stops admitting, lets in-flight requests finish, then loads; `hot_swap` loads at
once and in-flight requests continue on the new weights (each token carries its version).
Weights broadcast by the trainer (vLLM) are first staged and verified beside the running engine,
so the caller returns without waiting for the drain; only their load waits for a step boundary.

If the loop dies (an engine step raised), every pending request and update fails with
EngineDeadError and so does every later call; `stats()["healthy"]` turns False.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rlactors.engines.base import Engine
from rlactors.types import Completion, SamplingParams
from rlactors.weight_sync.checksum import ChecksumMismatch, state_checksum

logger = logging.getLogger(__name__)

UPDATE_MODES = ("drain", "hot_swap")


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
    version: int
    load: Callable[[], Any]  # runs between engine steps, in the engine thread
    mode: str
    future: asyncio.Future
    staged: bool = False  # already verified: a failing load leaves the model half-written
    queued_at: float = field(default_factory=time.perf_counter)


class AsyncEngine:
    def __init__(self, engine: Engine, default_update_mode: str = "drain"):
        if default_update_mode not in UPDATE_MODES:
            raise ValueError(f"update mode must be one of {UPDATE_MODES}, got {default_update_mode!r}")
        self.engine = engine
        self.default_update_mode = default_update_mode
        self._incoming: list[_Request] = []
        self._in_engine: dict[str, _Request] = {}
        self._aborts: list[str] = []
        self._update: _Update | None = None
        self._update_lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        self._stage_executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-stage")
        self._loop_task: asyncio.Task | None = None
        self._dead: BaseException | None = None
        self._closed = False
        self.counters = {"requests": 0, "completed": 0, "rejected": 0, "updates": 0}
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
        """Loads new weights between engine steps; returns timings.

        With a `checksum`, the received tensors are verified first: on a mismatch ChecksumMismatch
        is raised and the old weights keep serving. Bad names or shapes raise ValueError, likewise.
        """
        load = functools.partial(self._verify_and_load, named_tensors, checksum, version)
        return await self._load_between_steps(version, load, mode)

    async def receive_weights(self, version: int, checksum: str, mode: str | None = None) -> dict[str, Any]:
        """Weights broadcast by the trainer over NCCL (vLLM engine): received and verified now,
        loaded between engine steps later (after a drain, or at once for a hot swap).

        Returns once the weights are verified, so the trainer never waits for a drain. Requests
        that arrive after that are served by the new weights only: a pending update admits
        nothing. On a checksum mismatch ChecksumMismatch is raised and nothing is loaded. The
        buffer holds one version, so the next call waits until this one is loaded.
        """
        mode = self._checked_mode(mode)
        self._check_alive()
        await self._update_lock.acquire()
        try:
            self._check_alive()
            # Staging touches only the receive buffer; an engine that cannot stage while it steps
            # stages between steps, on the engine thread.
            executor = self._stage_executor if self.engine.stages_concurrently else self._executor
            staged = await asyncio.get_running_loop().run_in_executor(
                executor, self.engine.stage_weights, version, checksum)
        except BaseException:
            self._update_lock.release()
            raise
        update = _Update(version, functools.partial(self.engine.load_staged, version), mode,
                         asyncio.get_running_loop().create_future(), staged=True)
        update.future.add_done_callback(self._staged_update_done)
        self._update = update
        self._kick()
        return {"version": version, "mode": mode, **staged}

    def _staged_update_done(self, future: asyncio.Future) -> None:
        self._update_lock.release()
        if not future.cancelled() and future.exception() is None:
            self.counters["updates"] += 1
            self.last_update = future.result()

    def _verify_and_load(self, named_tensors: Mapping[str, torch.Tensor], checksum: str | None, version: int) -> Any:
        if checksum is not None:
            received = state_checksum(named_tensors)
            if received != checksum:
                raise ChecksumMismatch(
                    f"weights for version {version} do not match their checksum (got {received}, "
                    f"expected {checksum}); still serving version {self.engine.version}")
        return self.engine.load_weights(named_tensors, version)

    async def _load_between_steps(self, version: int, load: Callable[[], Any], mode: str | None) -> dict[str, Any]:
        """Runs `load` in the engine thread between two steps (after a drain, or at once for a hot
        swap), one update at a time; returns its timings."""
        mode = self._checked_mode(mode)
        self._check_alive()
        async with self._update_lock:
            start = time.perf_counter()
            update = _Update(version, load, mode, asyncio.get_running_loop().create_future())
            self._update = update
            self._kick()
            timings = await update.future
            self.counters["updates"] += 1
            self.last_update = timings
            return {"version": version, "mode": mode, "total_s": time.perf_counter() - start, **timings}

    def _checked_mode(self, mode: str | None) -> str:
        mode = mode or self.default_update_mode
        if mode not in UPDATE_MODES:
            raise ValueError(f"update mode must be one of {UPDATE_MODES}, got {mode!r}")
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
        self._executor.shutdown(wait=True)
        # A receive waits in NCCL for its sender, which may be gone (the trainer died): do not
        # wait for it; the proc is stopped next.
        self._stage_executor.shutdown(wait=False, cancel_futures=True)

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
            if update is not None and (update.mode == "hot_swap" or not self.engine.has_unfinished()):
                await self._apply_update(update)
            draining = self._update is not None  # a drain waits: admit nothing new meanwhile
            if not draining:
                self._admit()
            if self.engine.has_unfinished():
                start = time.perf_counter()
                completions = await loop.run_in_executor(self._executor, self.engine.step)
                self.busy_s += time.perf_counter() - start
                for completion in completions:
                    self._finish(completion)
            elif self._closed:
                return
            elif not self._incoming and self._update is None:
                await self._wake.wait()
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
        try:
            engine_timings = await loop.run_in_executor(self._executor, update.load)
        except (ValueError, ChecksumMismatch) as e:
            update.future.set_exception(e)
            if update.staged:
                raise  # the loop dies: this replica must not serve what it holds now
        except BaseException as e:
            update.future.set_exception(EngineDeadError(f"loading weights version {update.version} failed: {e!r}"))
            raise
        else:
            update.future.set_result({"wait_s": waited, "apply_s": time.perf_counter() - start, **(engine_timings or {})})
        finally:
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
