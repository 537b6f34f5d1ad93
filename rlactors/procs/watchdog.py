"""LoopWatchdog: tells when a call blocks the controller's event loop, and where.

Every rollout, env call, timeout and Ctrl-C of the controller runs on one asyncio loop. A call
that blocks it (an env's `time.sleep`, a blocking HTTP client, long CPU work without an await)
stops all of them at once, and `rollout.step_timeout_s` cannot fire: the timeout is a callback of
the same loop. A thread of its own can still see it: it posts a heartbeat to the loop and, when
the heartbeat has waited `after_s`, prints one line naming the code the loop is stuck in (from
that thread's stack), and another once the loop runs again.
"""

from __future__ import annotations

import asyncio
import linecache
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import TextIO

_ASYNCIO_DIR = Path(asyncio.__file__).parent
OFFLOAD_HINT = "run blocking work with `await asyncio.to_thread(...)` (docs/writing_envs.md)"


class LoopWatchdog:
    """Watches the running loop it was started in, from a daemon thread, every `poll_s`."""

    def __init__(self, after_s: float, poll_s: float = 0.5, out: TextIO | None = None) -> None:
        self.after_s = after_s
        self.poll_s = poll_s
        self.out = out
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._posted_at: float | None = None  # when the pending heartbeat was posted; None: none pending
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reported = False

    def start(self) -> None:
        """Watches the running loop (call from inside it)."""
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="loop-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def blocked_for(self) -> float:
        """Seconds the loop has not run a heartbeat posted to it (0 when it has)."""
        posted = self._posted_at
        return 0.0 if posted is None else time.monotonic() - posted

    def where(self, frame: FrameType | None = None) -> str:
        """Where the loop's thread is: the calls of the coroutine the loop is running, innermost
        last, and the line it is on. `frame`: that thread's current frame (default: read from
        another thread)."""
        frame = frame or sys._current_frames().get(self._loop_thread)
        stack = []
        while frame is not None:
            stack.append(frame)
            frame = frame.f_back
        stack.reverse()
        # The loop's own frames (asyncio's) come first; what follows the last of them is running.
        last_loop_frame = max((i for i, f in enumerate(stack) if _in_asyncio(f)), default=-1)
        running = stack[last_loop_frame + 1:] or stack[-1:]
        if not running:
            return "an unknown place"
        names = [f.f_code.co_qualname for f in running]
        if len(names) > 4:
            names = names[:2] + ["..."] + names[-2:]
        inner = running[-1]
        line = linecache.getline(inner.f_code.co_filename, inner.f_lineno).strip()
        return f"{' -> '.join(names)} ({inner.f_code.co_filename}:{inner.f_lineno}: {line})"

    def _beat(self) -> None:
        blocked = self.blocked_for()
        self._posted_at = None
        if self._reported:
            self._reported = False
            self._print(f"the controller's event loop runs again, after {blocked:.0f} s blocked")

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self._posted_at is None:
                self._posted_at = time.monotonic()
                try:
                    self._loop.call_soon_threadsafe(self._beat)
                except RuntimeError:  # the loop is closed
                    return
            elif not self._reported and self.blocked_for() >= self.after_s:
                self._reported = True
                self._print(f"warning: the controller's event loop has been blocked for {self.blocked_for():.0f} s "
                            f"in {self.where()}: no rollout or timeout runs until that call returns "
                            f"(rollout.step_timeout_s cannot end it); {OFFLOAD_HINT}")

    def _print(self, line: str) -> None:
        print(line, file=self.out or sys.stderr, flush=True)


def _in_asyncio(frame: FrameType) -> bool:
    return Path(frame.f_code.co_filename).parent == _ASYNCIO_DIR
