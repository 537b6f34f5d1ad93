"""LoopWatchdog: a call that blocks the event loop is named, with the line it is stuck on."""

import asyncio
import time

from rlactors.procs.watchdog import LoopWatchdog


class SlowEnv:
    async def step(self):
        time.sleep(3.0)  # blocks the loop, as a blocking client would


def test_a_call_that_blocks_the_loop_is_named_and_the_loop_running_again_is_said(capsys):
    async def main():
        watchdog = LoopWatchdog(after_s=0.5, poll_s=0.1)
        watchdog.start()
        try:
            await asyncio.sleep(0.3)  # an idle loop is not blocked
            await asyncio.wait_for(SlowEnv().step(), 1.0)  # the timeout cannot fire: the loop is blocked
            await asyncio.sleep(0.3)  # the heartbeat runs again
        finally:
            watchdog.stop()

    asyncio.run(main())
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("warning: the controller's event loop has been blocked for ")
    line = SlowEnv.step.__code__.co_firstlineno + 1
    assert (f" s in SlowEnv.step ({__file__}:{line}: time.sleep(3.0)  # blocks the loop, as a blocking client would): "
            "no rollout or timeout runs until that call returns (rollout.step_timeout_s cannot end it); run "
            "blocking work with `await asyncio.to_thread(...)` (docs/writing_envs.md)") in lines[0]
    assert lines[1].startswith("the controller's event loop runs again, after ") and lines[1].endswith(" s blocked")


def test_a_loop_that_awaits_is_never_reported(capsys):
    async def main():
        watchdog = LoopWatchdog(after_s=5.0, poll_s=0.1)
        watchdog.start()
        try:
            await asyncio.gather(*(asyncio.sleep(0.5) for _ in range(10)))
            await asyncio.to_thread(time.sleep, 1.0)  # offloaded: the loop goes on
            return watchdog.blocked_for()
        finally:
            watchdog.stop()

    assert asyncio.run(main()) < 5.0
    assert capsys.readouterr().err == ""
