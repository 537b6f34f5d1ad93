"""RolloutProducer: starts each step's rollout groups once their policy is on the generators, and
owns the tasks it starts.

Step `s`'s groups start once the generators hold the policy of step `s - 1 - ahead`: with
`ahead` = 0 (sync training) every token of step `s` comes from the policy of step `s - 1`; with
`ahead` = `controller.max_staleness` (async) generation runs up to that many steps ahead of the
trainer. The rule counts steps, not policy versions: a step that trained nothing keeps the
policy, and the step after it must not wait for a version that never comes.

Finished groups are handed over in completion order, whichever step started them. `stop()`
cancels every group still running and the loop that starts them, and returns once they are
gone, so no rollout outlives the training that asked for it.
"""

from __future__ import annotations

import asyncio

from rlactors.rollout.env import SampleStream
from rlactors.rollout.rollouter import Rollouter
from rlactors.rollout.types import Episode, RolloutGroup


class RolloutProducer:
    """The rollout groups of steps `first_step..last_step`, `groups_per_step` each."""

    def __init__(self, rollouter: Rollouter, samples: SampleStream, groups_per_step: int, ahead: int,
                 first_step: int, last_step: int):
        self.rollouter = rollouter
        self.samples = samples
        self.groups_per_step = groups_per_step
        self.ahead = ahead
        self.first_step, self.last_step = first_step, last_step
        self.reached_step = first_step - 1  # the newest step whose policy the generators hold
        self._step_reached = asyncio.Condition()
        self._finished: asyncio.Queue[RolloutGroup | BaseException] = asyncio.Queue()
        self._groups: set[asyncio.Task] = set()
        self._loop: asyncio.Task | None = None
        # Step -> the sample stream's and the rollouter's states when its groups were started:
        # where a run resumed after the step before it continues. Only steps not yet reached.
        self._states_at_start: dict[int, dict[str, dict[str, int]]] = {}

    def start(self) -> None:
        self._loop = asyncio.ensure_future(self._run())
        self._loop.add_done_callback(self._hand_over)

    async def reached(self, step: int) -> None:
        """The generators hold the policy of `step` (pushed, or unchanged by it)."""
        async with self._step_reached:
            self.reached_step = step
            self._step_reached.notify_all()
        for started in [s for s in self._states_at_start if s <= step]:
            del self._states_at_start[started]  # no checkpoint from now on resumes before it

    async def next_group(self) -> RolloutGroup:
        """The next group to finish; raises the exception that ended a group (or the loop)."""
        item = await self._finished.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def resume_state(self, step: int) -> dict[str, dict[str, int]]:
        """The states to resume from before step `step`: as they were when its groups started,
        or as they are now if they have not started."""
        return self._states_at_start.get(step) or self._states()

    async def stop(self) -> None:
        """Cancels the loop and every group still running; returns once they have ended."""
        tasks = [t for t in (self._loop, *self._groups) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _states(self) -> dict[str, dict[str, int]]:
        return {"samples": self.samples.state_dict(), "rollouter": self.rollouter.state_dict()}

    async def _run(self) -> None:
        for step in range(self.first_step, self.last_step + 1):
            async with self._step_reached:
                await self._step_reached.wait_for(lambda: self.reached_step >= step - 1 - self.ahead)  # noqa: B023
            self._states_at_start[step] = self._states()
            for sample in self.samples.next(self.groups_per_step):
                task = asyncio.ensure_future(self.rollouter.run_group(sample))
                self._groups.add(task)
                task.add_done_callback(self._hand_over)

    def _hand_over(self, task: asyncio.Task) -> None:
        """A finished group, or what ended a group or the loop, goes to `next_group`."""
        self._groups.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            self._finished.put_nowait(error)
        elif task is not self._loop:
            self._finished.put_nowait(task.result())


def fresh_episodes(groups: list[RolloutGroup], version: int,
                   max_staleness: int) -> tuple[list[Episode], list[int], int]:
    """The episodes of `groups` at most `max_staleness` versions older than the trainer's policy
    `version`, their ages (versions between `version` and the oldest policy that generated the
    episode), and how many were older (dropped)."""
    episodes, ages, stale = [], [], 0
    for episode in (e for group in groups for e in group.episodes):
        generated = [v for v in episode.versions if v >= 0]
        age = version - min(generated) if generated else 0
        if age > max_staleness:
            stale += 1
            continue
        episodes.append(episode)
        ages.append(age)
    return episodes, ages, stale
