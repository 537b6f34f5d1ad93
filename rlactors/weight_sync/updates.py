"""A replica's side of weight sync, beside its engine loop (rlactors.engines.async_engine).

Weights come in two phases: each new version is verified beside the running engine and the call
returns; the engine loop loads it later, between steps (`due`, `load`), after a drain or at once
for a hot swap. While a verified version waits for its load the loop admits nothing new, so every
request sent after an update runs on that version or a newer one; a version that arrives before
the previous one was loaded replaces it (newest wins). By messages (`update_weights`) the tensors
come with the call and load through the engine's `load_weights`; by broadcast (`join_weight_group`,
`receive_weights`) they land in the engine's receive buffer (`Engine.broadcast_receiver()`), which
holds one version; through the trainer's shared buffer (`load_shared`) they are checked
and loaded from it before the call returns. What a failed receive leaves behind: docs/ARCHITECTURE.md,
"Weight sync".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import time
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from rlactors.config import UpdateMode
from rlactors.weight_sync.broadcast import BroadcastBroken, BroadcastReceiver
from rlactors.weight_sync.checksum import ChecksumMismatch, state_checksum
from rlactors.weight_sync.shared import SharedHandle, SharedReceiver

UPDATE_MODES = typing.get_args(UpdateMode)


class UpdatedEngine(Protocol):
    """What weight updates need of an engine (rlactors.engines.base.Engine, which has it all)."""

    version: int
    hot_swaps: bool
    stages_concurrently: bool

    def broadcast_receiver(self) -> BroadcastReceiver: ...

    def check_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None: ...

    def load_weights(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> None: ...


def stages_concurrently(tp: int) -> bool:
    """Whether a replica of `tp` GPUs receives a weight broadcast beside its engine's steps
    (`Engine.stages_concurrently`): one whose one GPU worker runs in the replica's own process
    (the native engine, tp = 1 always; vLLM at tp = 1). With TP workers in other processes, vLLM's
    collective_rpc and step() share its message queues, so a receive waits for a step boundary."""
    return tp == 1


@dataclass
class PendingLoad:
    """Verified weights waiting for a step boundary."""

    version: int
    load: Callable[[], Any]  # runs between engine steps, in the engine thread
    mode: str
    future: asyncio.Future  # the load's timings; cancelled when a newer version replaces it
    queued_at: float = field(default_factory=time.perf_counter)
    held: bool = False  # its receive buffer is being overwritten: not loadable until replaced
    applying: bool = False


class WeightUpdates:
    """The weight updates of one engine. `check_alive` raises once the engine loop is dead or
    closed; `wake` has the loop look for a load. Loads and, for an engine that cannot stage while
    it steps, receives run on `step_executor`, the engine's thread."""

    def __init__(self, engine: UpdatedEngine, default_mode: UpdateMode, step_executor: concurrent.futures.Executor,
                 check_alive: Callable[[], None], wake: Callable[[], None]):
        self.engine = engine
        self.default_mode = default_mode
        self.step_executor = step_executor
        self.side_executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-side")
        self.check_alive = check_alive
        self.wake = wake
        self.receiver = engine.broadcast_receiver()
        self.shared = SharedReceiver()
        self.pending: PendingLoad | None = None
        self._receive_lock = asyncio.Lock()  # one incoming version at a time, in order
        self.counters = {"updates": 0, "superseded": 0}
        self.last_update: dict[str, Any] = {}  # timings of the last weights loaded

    # -- arrivals ---------------------------------------------------------------------------

    async def update_weights(self, version: int, named_tensors: Mapping[str, torch.Tensor],
                             checksum: str | None = None, mode: str | None = None) -> dict[str, Any]:
        """Verifies new weights and queues their load between engine steps; returns once verified.

        With a `checksum`, the received tensors must match it (else ChecksumMismatch); names and
        shapes must match the model (else ValueError). Either way the old weights keep serving.
        """
        mode = self._checked_mode(mode)
        async with self._receive_lock:
            self.check_alive()
            start = time.perf_counter()
            await asyncio.get_running_loop().run_in_executor(
                self.side_executor, self._verify, named_tensors, checksum, version)
            self.check_alive()
            self._queue(PendingLoad(version, functools.partial(self.engine.load_weights, named_tensors, version),
                                    mode, asyncio.get_running_loop().create_future()))
            return {"version": version, "mode": mode, "verify_s": time.perf_counter() - start}

    async def receive_weights(self, version: int, mode: str | None = None) -> dict[str, Any]:
        """The trainer's next broadcast (which must carry `version`), received into the engine's
        buffer and verified now, loaded between engine steps later. Returns once verified
        (ChecksumMismatch or UnexpectedVersion if not)."""
        mode = self._checked_mode(mode)
        async with self._receive_lock:
            self.check_alive()
            overwritten = await self._hold_pending()
            self.check_alive()
            try:
                staged = await asyncio.get_running_loop().run_in_executor(
                    self._staging_executor, self.receiver.receive, version)
            except BroadcastBroken:
                raise  # a version it overwrote stays held: the push broadcasts again, to a new group
            except BaseException as e:
                if overwritten is not None:
                    overwritten.load = functools.partial(_raise, e)  # its load ends the engine loop
                    overwritten.held = False
                    self.wake()
                raise
            self.check_alive()
            self._queue(PendingLoad(version, functools.partial(self.receiver.load, version), mode,
                                    asyncio.get_running_loop().create_future()))
            return {"version": version, "mode": mode, **staged}

    async def load_shared(self, handle: SharedHandle, version: int, checksum: str,
                          mode: str | None = None) -> dict[str, Any]:
        """Checks the trainer's shared buffer (mapped at the first call) against `checksum`
        (ChecksumMismatch if it differs: the old weights keep serving), then loads it between
        engine steps; returns once loaded, so the buffer may be repacked."""
        mode = self._checked_mode(mode)
        async with self._receive_lock:
            self.check_alive()
            start = time.perf_counter()
            views = await asyncio.get_running_loop().run_in_executor(
                self.side_executor, self.shared.verified_views, handle, version, checksum)
            self.check_alive()
            verified = time.perf_counter()
            update = PendingLoad(version, functools.partial(self._load_views, views, version), mode,
                                 asyncio.get_running_loop().create_future())
            self._queue(update)
            loaded = await update.future
            return {**loaded, "verify_s": verified - start}

    def _load_views(self, views: Mapping[str, torch.Tensor], version: int) -> None:
        self.engine.load_weights(views, version)
        if next(iter(views.values())).is_cuda:
            torch.cuda.current_stream().synchronize()  # the copies out of the buffer are done

    async def join_weight_group(self, host: str, port: int, rank_offset: int, world_size: int,
                                layout: Any) -> list[int]:
        """Joins a weight broadcast group, in place of any earlier one. Runs between receives,
        where receives run; the receive buffer and a version in it that waits for its load stay.
        Returns the ranks taken."""
        async with self._receive_lock:
            self.check_alive()
            return await asyncio.get_running_loop().run_in_executor(
                self._staging_executor, self.receiver.join, host, port, rank_offset, world_size, layout)

    @property
    def _staging_executor(self) -> concurrent.futures.Executor:
        """Where receives and group joins run: they touch only the receive buffer, so beside the
        engine; an engine that cannot stage while it steps stages between steps, on its thread."""
        return self.side_executor if self.engine.stages_concurrently else self.step_executor

    def _verify(self, named_tensors: Mapping[str, torch.Tensor], checksum: str | None, version: int) -> None:
        if checksum is not None:
            received = state_checksum(named_tensors)
            if received != checksum:
                raise ChecksumMismatch(
                    f"weights for version {version} do not match their checksum (got {received}, "
                    f"expected {checksum}); still serving version {self.engine.version}")
        self.engine.check_weights(named_tensors)

    async def _hold_pending(self) -> PendingLoad | None:
        """Keeps the pending load from running while its buffer is overwritten; returns it. A
        load already running is waited for instead (the buffer is free after it)."""
        pending = self.pending
        if pending is None:
            return None
        if pending.applying:
            await asyncio.wait([pending.future])
            return None
        pending.held = True
        return pending

    def _queue(self, update: PendingLoad) -> None:
        """Makes `update` the next load; a pending one that has not started loading is dropped."""
        pending = self.pending
        if pending is not None and not pending.applying:
            pending.future.cancel()
            self.counters["superseded"] += 1
        update.future.add_done_callback(self._loaded)
        self.pending = update
        self.wake()

    def _loaded(self, future: asyncio.Future) -> None:
        if not future.cancelled() and future.exception() is None:
            self.counters["updates"] += 1
            self.last_update = future.result()

    def _checked_mode(self, mode: str | None) -> str:
        mode = mode or self.default_mode
        if mode not in UPDATE_MODES:
            raise ValueError(f"update mode must be one of {UPDATE_MODES}, got {mode!r}")
        if mode == "hot_swap" and not self.engine.hot_swaps:
            raise ValueError("this engine loads weights between requests only (started for "
                             "generator.update_mode = 'drain'): it cannot hot swap")
        return mode

    # -- loads, in the engine loop ----------------------------------------------------------

    @property
    def waiting(self) -> bool:
        """Verified weights wait for their load: the loop admits no new request."""
        return self.pending is not None

    @property
    def loadable(self) -> bool:
        return self.pending is not None and not self.pending.held

    def due(self, busy: bool) -> PendingLoad | None:
        """The load to run at this step boundary, if any: a hot swap at once, a drain once the
        engine has nothing unfinished (`busy` False)."""
        pending = self.pending
        if pending is not None and not pending.held and (pending.mode == "hot_swap" or not busy):
            return pending
        return None

    async def load(self, update: PendingLoad) -> None:
        """Runs the load in the engine thread. Raises if it fails: the weights were verified, so
        the model is half-written and the replica must not serve it."""
        waited = time.perf_counter() - update.queued_at
        start = time.perf_counter()
        update.applying = True
        try:
            engine_timings = await asyncio.get_running_loop().run_in_executor(self.step_executor, update.load)
        except BaseException as e:
            update.future.set_exception(RuntimeError(f"loading weights version {update.version} failed: {e!r}"))
            raise
        else:
            update.future.set_result({"version": update.version, "wait_s": waited,
                                      "apply_s": time.perf_counter() - start, **(engine_timings or {})})
        finally:
            if self.pending is update:
                self.pending = None

    def fail(self, error: BaseException) -> None:
        """The engine loop died: the pending load never runs."""
        if self.pending is not None and not self.pending.future.done():
            self.pending.future.set_exception(error)
        self.pending = None

    def close(self) -> None:
        # A receive waits for its sender, which may be gone (the trainer died; NCCL waits for
        # ever): do not wait for it; the proc is stopped next.
        self.side_executor.shutdown(wait=False, cancel_futures=True)


def _raise(error: BaseException) -> None:
    raise error
