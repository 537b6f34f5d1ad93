"""rlactors.procs.liveness without Monarch: a real child process for exits (with their status), pings
that a test answers or withholds for silence, and calls failed by a lost proc's verdict."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time

import pytest
from support.linux import PIDFD_KEEPS_EXIT_STATUS

from rlactors.procs.liveness import ProcLost, ProcWatcher, describe_failure, describe_wait_status, this_machine


def test_wait_statuses_and_monarch_failures_are_named():
    assert describe_wait_status(signal.SIGKILL) == "exited (signal 9)"
    assert describe_wait_status(3 << 8) == "exited with code 3"
    assert describe_wait_status(None).startswith("exited (exit status not seen")
    monarch = ("The actor <root>.<W w0{'gpus': 0/1}> and all its descendants have failed: the process this actor "
               "was running on failed: Killed(sig=9)")
    assert describe_failure(RuntimeError(monarch)) == "exited (signal 9)"
    assert describe_failure(RuntimeError("... exited with non-zero code 7")) == "exited with code 7"
    assert describe_failure(RuntimeError("boom\n  here")) == "failed: boom here"


class Pinged:
    """A ping for `pid` that answers at once unless `silent` is set."""

    def __init__(self, pid: int):
        self.pid, self.silent = pid, asyncio.Event()

    async def __call__(self):
        if self.silent.is_set():
            await asyncio.Event().wait()  # never answers
        return {"machine": this_machine(), "pid": self.pid}


def _child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


@pytest.mark.parametrize(("code", "kill", "verdict"), [
    ("import time; time.sleep(60)", True, "exited (signal 9)"),
    ("import sys, time; time.sleep(0.5); sys.exit(3)", False, "exited with code 3"),
])
def test_an_exit_is_the_verdict_at_once_with_its_status_and_fails_pending_calls(code, kill, verdict):
    child = _child(code)

    async def main():
        watcher = ProcWatcher(60.0)
        proc = await watcher.watch("worker", Pinged(child.pid))
        pending = asyncio.ensure_future(watcher.race(asyncio.Event().wait(), [proc]))
        if kill:
            os.kill(child.pid, signal.SIGKILL)
        with pytest.raises(ProcLost) as lost:
            await asyncio.wait_for(pending, 10)
        # A call made after the verdict fails before it starts.
        with pytest.raises(ProcLost):
            await watcher.race(asyncio.sleep(0), [proc])
        watcher.close()
        return str(lost.value)

    try:
        assert asyncio.run(main()) == f"worker (pid {child.pid}) {verdict}"
    finally:
        child.kill()
        child.wait()


def test_an_exit_reaped_by_its_parent_before_the_watcher_reads_it_keeps_its_status():
    """As when Monarch's host agent reaps a proc first: the status is read from the pidfd (Linux
    6.15+); on an older kernel the verdict says it was not seen, never a wrong status."""
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(child.pid, flush=True)\n"
        "child.wait()\n"  # reaps it the moment it ends
        "time.sleep(60)")], stdout=subprocess.PIPE, text=True)
    pid = int(parent.stdout.readline())

    async def main():
        watcher = ProcWatcher(60.0)
        proc = await watcher.watch("worker", Pinged(pid))
        os.kill(pid, signal.SIGKILL)
        # The loop is held until its parent has reaped it: the watcher reads only after the reap.
        started = time.monotonic()
        while os.path.exists(f"/proc/{pid}"):
            assert time.monotonic() - started < 10, "the parent did not reap its child"
            time.sleep(0.01)
        with pytest.raises(ProcLost) as lost:
            await asyncio.wait_for(watcher.race(asyncio.Event().wait(), [proc]), 10)
        watcher.close()
        return str(lost.value)

    try:
        verdict = asyncio.run(main())
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
    expected = "exited (signal 9)" if PIDFD_KEEPS_EXIT_STATUS else describe_wait_status(None)
    assert verdict == f"worker (pid {pid}) {expected}"


def test_a_silent_proc_is_slow_then_lost_and_killed_after_the_timeout(caplog):
    child = _child("import time; time.sleep(60)")

    async def main():
        watcher = ProcWatcher(1.5, ping_every_s=0.05, slow_after_s=0.3, report_every_s=10.0)
        ping = Pinged(child.pid)
        proc = await watcher.watch("worker", ping)
        ping.silent.set()
        await asyncio.sleep(0.1)
        assert not watcher.slow(proc)
        await asyncio.sleep(0.5)
        assert watcher.slow(proc) and watcher.lost(proc) is None  # slow, not lost
        with pytest.raises(ProcLost) as raised:
            await asyncio.wait_for(watcher.race(asyncio.Event().wait(), [proc]), 10)
        watcher.close()
        return str(raised.value)

    try:
        with caplog.at_level(logging.WARNING, logger="rlactors.procs.liveness"):
            message = asyncio.run(main())
        assert child.wait(10) == -signal.SIGKILL  # lost for good: killed by the watcher
    finally:
        child.kill()
        child.wait()
    assert message.startswith(f"worker (pid {child.pid}) unresponsive for ") and \
        message.endswith("(alive, but no answer within controller.unresponsive_timeout_s=1.5)")
    said = [r.getMessage() for r in caplog.records]
    assert any(f"worker (pid {child.pid}) unresponsive for 0 s (counted lost after" in line for line in said), said


class SteppedClock:
    """A watcher's clock that moves only when the test moves it; counts its reads."""

    def __init__(self):
        self.now, self.reads = 0.0, 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now


class CountedPing(Pinged):
    def __init__(self, pid: int):
        super().__init__(pid)
        self.calls = 0

    async def __call__(self):
        self.calls += 1
        return await super().__call__()


async def _until(condition) -> None:
    async def poll():
        while not condition():
            await asyncio.sleep(0.001)
    await asyncio.wait_for(poll(), 30)


def test_a_watcher_that_was_paused_pings_afresh_before_judging_and_still_finds_a_silent_proc_lost(caplog):
    """The watcher's process stopped for 75 s (SIGSTOP) under a 60 s timeout: by its clock the proc was
    silent 75 s, but the watcher was away; it pings afresh, the live proc is not lost (nor killed), and
    a proc that then stays silent while the watcher runs is lost 60 s after the fresh ping."""
    child = _child("import time; time.sleep(120)")

    async def main():
        clock = SteppedClock()
        watcher = ProcWatcher(60.0, ping_every_s=0.01, clock=clock)
        ping = CountedPing(child.pid)
        proc = await watcher.watch("worker", ping)
        ping.silent.set()
        await _until(lambda: ping.calls == 2)  # the first ping of the loop, sent at 0 s, unanswered
        clock.now = 75.0  # what the watcher's clock reads when it runs again
        await _until(lambda: ping.calls == 3)  # asked afresh, at 75 s
        reads = clock.reads
        await _until(lambda: clock.reads >= reads + 3)  # it has checked the fresh ping since
        paused = (watcher.lost(proc), watcher.slow(proc), child.poll())
        while watcher.lost(proc) is None:  # the watcher runs on, the proc stays silent
            clock.now += 1.0
            reads = clock.reads
            await _until(lambda: clock.reads >= reads + 2 or watcher.lost(proc) is not None)  # noqa: B023
        watcher.close()
        return paused, watcher.lost(proc), clock.now

    try:
        with caplog.at_level(logging.WARNING, logger="rlactors.procs.liveness"):
            paused, verdict, lost_at = asyncio.run(main())
        assert paused == (None, False, None)  # not lost, not slow, not killed
        assert lost_at == 135.0
        assert verdict == (f"worker (pid {child.pid}) unresponsive for 60 s (alive, but no answer within "
                           "controller.unresponsive_timeout_s=60)")
        assert child.wait(10) == -signal.SIGKILL  # lost for good then: killed by the watcher
    finally:
        child.kill()
        child.wait()
    said = [r.getMessage() for r in caplog.records]
    # Where Monarch runs in this process its log prefix ("[actor=...]") comes before each line.
    assert any(line.endswith(f"worker (pid {child.pid}): this watcher did not run for 75 s (its process stopped or "
                             "starved); pinging it afresh before judging it") for line in said), said
