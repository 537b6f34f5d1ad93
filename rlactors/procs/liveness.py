"""Liveness: tell a dead proc from a slow one, by construction.

Each watched proc answers pings (the `Liveness` actor of rlactors.procs.liveness_actor, on its own
thread) with its machine and OS pid. `ProcWatcher` keeps two facts per proc:

- Exited: on this machine a pidfd turns readable the moment the process ends, with its wait
  status ("exited (signal 9)"); a proc on another machine is dead when a ping fails.
- Unresponsive: unanswered for `slow_after_s`, a proc is slow (logged every `report_every_s`);
  for `unresponsive_timeout_s`, lost (and, on this machine, killed). One that answers is back.
  Silence is measured by the watcher's clock: a check `PAUSED_AFTER_S` late finds the watcher
  itself was paused (SIGSTOP, Ctrl-Z) and pings afresh.

A lost proc's verdict fails every call made through `guard` at once, with `ProcLost`, before
Monarch notices (rlactors.procs.supervision). In full: docs/ARCHITECTURE.md, "Failover".
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import re
import signal
import socket
import struct
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger(__name__)

TIMEOUT_KEY = "controller.unresponsive_timeout_s"  # the setting, named in the verdicts
PING_EVERY_S = 1.0
# An exit whose status is not readable yet (its reap under way) is read again every
# STATUS_RETRY_S; after STATUS_WAIT_S (a kernel without PIDFD_INFO_EXIT) Monarch's word is awaited.
STATUS_RETRY_S = 0.02
STATUS_WAIT_S = 1.5
# linux/pidfd.h: ioctl PIDFD_GET_INFO = _IOWR(0xFF, 11, struct pidfd_info) for the 64-byte struct
# of Linux 6.13, whose s32 exit_code (a wait status) sits at byte 60; PIDFD_INFO_EXIT (6.15+).
PIDFD_GET_INFO = 0xC040FF0B
PIDFD_INFO_EXIT = 1 << 3
PIDFD_INFO_SIZE = 64
SLOW_AFTER_S = 3.0
REPORT_EVERY_S = 10.0
PAUSED_AFTER_S = 5.0


class ProcLost(RuntimeError):
    """A watched proc exited, or stayed unresponsive past the timeout; the message is the verdict."""


def this_machine() -> str:
    return socket.gethostname()


def describe_wait_status(status: int | None) -> str:
    """'exited (signal 9)', 'exited with code 1', or why the wait status was not seen."""
    if status is None:
        return "exited (exit status not seen: its parent reaped it first, and this kernel keeps none)"
    if os.WIFSIGNALED(status):
        return f"exited (signal {os.WTERMSIG(status)})"
    return f"exited with code {os.waitstatus_to_exitcode(status)}"


def describe_failure(error: BaseException) -> str:
    """A failed ping's cause as an exit where Monarch names one (a proc on another machine)."""
    text = " ".join(str(error).split())
    if match := re.search(r"Killed\(sig=(\d+)", text):
        return f"exited (signal {match.group(1)})"
    if match := re.search(r"exited with non-zero code (-?\d+)", text):
        return f"exited with code {match.group(1)}"
    return f"failed: {text}"


def _peek_wait_status(pidfd: int, block: bool) -> int | None:
    """The wait status of a child of this process, peeked without reaping it (its reaper is
    Monarch's host agent), or None once reaped or when not a child."""
    try:
        result = os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOWAIT | (0 if block else os.WNOHANG))
    except (ChildProcessError, OSError):
        return None
    if result is None:
        return None
    if result.si_code == os.CLD_EXITED:
        return (result.si_status & 0xFF) << 8
    return result.si_status & 0x7F  # killed or dumped: the signal


def _reaped_wait_status(pidfd: int) -> int | None:
    """The wait status of a reaped process, kept by its pidfd (Linux 6.15+), else None."""
    info = bytearray(PIDFD_INFO_SIZE)
    struct.pack_into("Q", info, 0, PIDFD_INFO_EXIT)
    try:
        fcntl.ioctl(pidfd, PIDFD_GET_INFO, info)
    except OSError:  # a kernel before 6.13, or no process behind the pidfd any more
        return None
    if not struct.unpack_from("Q", info, 0)[0] & PIDFD_INFO_EXIT:
        return None  # not reaped yet, or a kernel before 6.15
    return struct.unpack_from("i", info, 60)[0]


def _read_wait_status(pid: int, pidfd: int) -> int | None:
    """The wait status of an ended process: peeked (a zombie child), read from /proc (a zombie),
    or kept by its pidfd (reaped); None while its reap is under way (or the kernel keeps none)."""
    if (status := _peek_wait_status(pidfd, block=False)) is not None:
        return status
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        if fields[0] == "Z":
            return int(fields[-1])  # field 52: exit_code, a wait status
    except (OSError, ValueError, IndexError):
        pass
    return _reaped_wait_status(pidfd)


def _parent_of(pid: int) -> int | None:
    try:
        return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def with_descendants(pids: list[int]) -> list[int]:
    """`pids` and every process started under them (a replica's proc under the router's, vLLM's
    engine processes under a replica's), parents first (Linux /proc)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (parent := _parent_of(int(entry))) is not None:
            parents[int(entry)] = parent
    found = list(pids)
    for pid in found:  # grows as children are found
        found += [child for child, parent in parents.items() if parent == pid and child not in found]
    return found


class WatchedProc:
    """One OS process under watch: its name, where it runs, and its verdict once lost."""

    def __init__(self, name: str, ping: Callable[[], Awaitable[Any]], verdict: asyncio.Future):
        self.name = name
        self.ping = ping
        self.verdict = verdict  # resolves to the message once the proc is lost
        self.pid: int | None = None
        self.machine: str | None = None
        self.silent_since: float | None = None  # when the unanswered ping was sent
        self.task: asyncio.Task | None = None
        self._pidfd: int | None = None

    @property
    def label(self) -> str:
        return f"{self.name} (pid {self.pid})" if self.pid is not None else self.name

    def silent_s(self, now: float | None = None) -> float:
        """Seconds its oldest unanswered ping has waited (0 when it answers)."""
        if self.silent_since is None:
            return 0.0
        return (now if now is not None else time.monotonic()) - self.silent_since


class ProcWatcher:
    """Watches procs for exits and silence (see the module docstring); one per event loop."""

    def __init__(self, unresponsive_timeout_s: float, *, ping_every_s: float = PING_EVERY_S,
                 slow_after_s: float = SLOW_AFTER_S, report_every_s: float = REPORT_EVERY_S,
                 clock: Callable[[], float] = time.monotonic):
        self.unresponsive_timeout_s = unresponsive_timeout_s
        self.ping_every_s = ping_every_s
        self.slow_after_s = slow_after_s
        self.report_every_s = report_every_s
        self.clock = clock  # what silence is measured by
        self.procs: list[WatchedProc] = []

    async def watch(self, name: str, ping: Callable[[], Awaitable[dict[str, Any]]]) -> WatchedProc:
        """Starts watching the proc that `ping()` reaches; its first answer ({'machine', 'pid'})
        says which OS process that is. Returns once it has answered."""
        proc = WatchedProc(name, ping, asyncio.get_running_loop().create_future())
        answer = await ping()
        proc.pid, proc.machine = int(answer["pid"]), str(answer["machine"])
        if proc.machine == this_machine():
            self._watch_exit(proc)
        proc.task = asyncio.ensure_future(self._ping_loop(proc))
        self.procs.append(proc)
        return proc

    def _watch_exit(self, proc: WatchedProc) -> None:
        try:
            proc._pidfd = os.pidfd_open(proc.pid)
        except (ProcessLookupError, PermissionError, OSError) as e:
            logger.warning("%s: cannot watch its process for exits (%s); relying on pings", proc.label, e)
            return
        loop = asyncio.get_running_loop()
        if _parent_of(proc.pid) == os.getpid():
            # A thread blocked in waitid is woken by the exit itself, usually before Monarch's
            # host agent (in this process) reaps the child: the status on a kernel that keeps
            # none after the reap (before 6.15), at once on any.
            def peek() -> None:
                status = _peek_wait_status(pidfd, block=True)
                if status is not None and proc._pidfd is not None:  # else no longer watched
                    try:
                        loop.call_soon_threadsafe(self._conclude, proc, describe_wait_status(status))
                    except RuntimeError:
                        pass  # its loop has closed since

            pidfd = proc._pidfd
            threading.Thread(target=peek, name=f"exit of {proc.label}", daemon=True).start()

        def read_status(deadline: float) -> None:
            if proc.verdict.done() or proc._pidfd is None:
                return
            status = _read_wait_status(proc.pid, proc._pidfd)
            if status is not None:
                self._conclude(proc, describe_wait_status(status))
            elif time.monotonic() < deadline:
                loop.call_later(STATUS_RETRY_S, read_status, deadline)
            else:
                # A kernel that keeps no status after the reap: Monarch names it to the ping
                # within about a second (_ping_loop), unless its state query to the proc is stuck.
                self._conclude(proc, describe_wait_status(None))

        def exited() -> None:
            loop.remove_reader(proc._pidfd)
            read_status(time.monotonic() + STATUS_WAIT_S)

        loop.add_reader(proc._pidfd, exited)

    def _conclude(self, proc: WatchedProc, what: str) -> None:
        if not proc.verdict.done():
            proc.verdict.set_result(f"{proc.label} {what}")
            logger.warning("%s %s", proc.label, what)

    async def _ping_loop(self, proc: WatchedProc) -> None:
        while not proc.verdict.done():
            proc.silent_since = checked = self.clock()
            answer = asyncio.ensure_future(proc.ping())
            reported_at = None
            away = 0.0  # how much later than meant this check came
            while not answer.done():
                await asyncio.wait([answer, proc.verdict], timeout=self.ping_every_s,
                                   return_when=asyncio.FIRST_COMPLETED)
                if proc.verdict.done():
                    answer.cancel()
                    return
                now = self.clock()
                away, checked = now - checked - self.ping_every_s, now
                if away >= PAUSED_AFTER_S:
                    answer.cancel()  # its silence spans the watcher's own absence: ask again
                    break
                silent = proc.silent_s(now)
                if silent >= self.unresponsive_timeout_s:
                    answer.cancel()
                    self._conclude(proc, f"unresponsive for {silent:.0f} s (alive, but no answer within "
                                         f"{TIMEOUT_KEY}={self.unresponsive_timeout_s:g})")
                    if proc._pidfd is not None:
                        # Lost for good: killed, so that it frees what it holds (a GPU) and its
                        # procs stop at once instead of after Monarch's graceful wait.
                        try:
                            signal.pidfd_send_signal(proc._pidfd, signal.SIGKILL)
                        except ProcessLookupError:
                            pass  # it has just exited
                    return
                if silent >= self.slow_after_s and (reported_at is None or now - reported_at >= self.report_every_s):
                    reported_at = now
                    logger.warning("%s unresponsive for %.0f s (counted lost after %s=%g s)", proc.label, silent,
                                   TIMEOUT_KEY, self.unresponsive_timeout_s)
            if away >= PAUSED_AFTER_S:
                logger.warning("%s: this watcher did not run for %.0f s (its process stopped or starved); "
                               "pinging it afresh before judging it", proc.label, away)
                continue
            if answer.cancelled():
                return
            if answer.exception() is not None:
                # Monarch found the proc gone (on another machine, the first news of an exit).
                self._conclude(proc, describe_failure(answer.exception()))
                return
            if reported_at is not None:
                logger.warning("%s answers again after %.0f s", proc.label, proc.silent_s(self.clock()))
            proc.silent_since = None
            await asyncio.wait([proc.verdict], timeout=self.ping_every_s)

    def slow(self, proc: WatchedProc) -> bool:
        """Its ping has waited `slow_after_s` or more (it is not lost yet)."""
        return proc.silent_s(self.clock()) >= self.slow_after_s

    def lost(self, *procs: WatchedProc) -> str | None:
        """The verdict of the first of `procs` that is lost, else None."""
        return next((p.verdict.result() for p in procs if p.verdict.done() and not p.verdict.cancelled()), None)

    async def race(self, call: Awaitable[Any], procs: list[WatchedProc]) -> Any:
        """`call`'s result, unless one of `procs` is lost first: then ProcLost with its verdict
        (the call is abandoned). Procs no longer watched do not count."""
        if (verdict := self.lost(*procs)) is not None:
            _abandon(call)
            raise ProcLost(verdict)
        task = asyncio.ensure_future(call)
        try:
            watching = [p.verdict for p in procs if not p.verdict.done()]
            while watching and not task.done():
                await asyncio.wait([task, *watching], return_when=asyncio.FIRST_COMPLETED)
                if not task.done() and (verdict := self.lost(*procs)) is not None:
                    _abandon(task)
                    raise ProcLost(verdict)
                watching = [v for v in watching if not v.done()]
            return await task
        except asyncio.CancelledError:  # the caller gave up: so does the call, whose failure nobody reads
            _abandon(task)
            raise

    def guard(self, actor: Any, procs: list[WatchedProc]) -> Any:
        """`actor` (an actor mesh) whose endpoint calls fail with ProcLost once one of `procs` is lost."""
        return _Guarded(actor, self, procs)

    def forget(self, proc: WatchedProc) -> None:
        """Stops watching `proc` (a proc about to be stopped on purpose)."""
        if proc.task is not None:
            proc.task.cancel()
        if proc._pidfd is not None:
            try:
                asyncio.get_running_loop().remove_reader(proc._pidfd)
            except RuntimeError:
                pass  # no loop: nothing registered any more
            os.close(proc._pidfd)
            proc._pidfd = None
        if not proc.verdict.done():
            proc.verdict.cancel()
        if proc in self.procs:
            self.procs.remove(proc)

    def close(self) -> None:
        """Stops watching every proc (before stopping them: their exits are then expected)."""
        for proc in list(self.procs):
            self.forget(proc)


def _abandon(call: Any) -> None:
    if isinstance(call, asyncio.Future):
        call.cancel()
        call.add_done_callback(lambda f: f.cancelled() or f.exception())  # abandoned, not an error
    elif asyncio.iscoroutine(call):
        call.close()


class _GuardedEndpoint:
    def __init__(self, endpoint: Any, watcher: ProcWatcher, procs: list[WatchedProc]):
        self._endpoint, self._watcher, self._procs = endpoint, watcher, procs

    async def call(self, *args: Any, **kwargs: Any) -> Any:
        return await self._watcher.race(self._endpoint.call(*args, **kwargs), self._procs)

    async def call_one(self, *args: Any, **kwargs: Any) -> Any:
        return await self._watcher.race(self._endpoint.call_one(*args, **kwargs), self._procs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._endpoint, name)


class _Guarded:
    """An actor mesh seen through `ProcWatcher.guard`."""

    def __init__(self, actor: Any, watcher: ProcWatcher, procs: list[WatchedProc]):
        self._actor, self._watcher, self._procs = actor, watcher, procs

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._actor, name)
        if hasattr(attr, "call_one"):
            return _GuardedEndpoint(attr, self._watcher, self._procs)
        return attr
