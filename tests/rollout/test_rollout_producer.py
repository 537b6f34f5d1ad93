"""RolloutProducer: every group handed over, generation at most `ahead` steps ahead, and no
rollout task left running once it stops, nor once the controller's training loop returns."""

import asyncio

import pytest
from support.rollouts import FakeGenerate, LengthRewardEnv, rollouter

from rlactors.config import load_config
from rlactors.rollout import SampleStream
from rlactors.rollout.producer import RolloutProducer
from rlactors.run.controller import Controller, TrainingError


def samples(n: int) -> SampleStream:
    return SampleStream([{"id": i} for i in range(n)], seed=0)


def others() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]


def test_the_producer_hands_over_every_group_and_runs_at_most_ahead_steps_ahead():
    async def consume():
        generate = FakeGenerate()
        producer = RolloutProducer(rollouter(LengthRewardEnv(turns=2), generate), samples(5), groups_per_step=1,
                                   ahead=1, first_step=1, last_step=5)
        producer.start()
        groups = []
        for step in range(1, 6):
            groups.append(await producer.next_group())
            await producer.reached(step)
        await producer.stop()
        return groups, generate

    groups, generate = asyncio.run(consume())
    assert sorted(g.group_id for g in groups) == [f"g{i}" for i in range(5)]
    assert [g.sample["id"] for g in sorted(groups, key=lambda g: g.group_id)] == \
        [s["id"] for s in samples(5).next(5)]
    assert generate.max_groups_in_flight == 2  # step s + 1 starts with step s; step s + 2 waits for step s


def test_stopping_the_producer_cancels_its_running_groups():
    async def consume():
        r = rollouter(LengthRewardEnv(turns=2))
        producer = RolloutProducer(r, samples(1000), groups_per_step=3, ahead=0, first_step=1, last_step=1000)
        producer.start()
        first = await producer.next_group()
        await producer.stop()
        return first, others(), r.state_dict()

    first, pending, state = asyncio.run(consume())
    assert first.group_id.startswith("g") and pending == []
    assert state["groups_started"] <= 4


def test_a_checkpoint_resumes_where_the_step_after_it_started_and_only_unreached_steps_are_kept():
    async def drive():
        producer = RolloutProducer(rollouter(LengthRewardEnv()), samples(100), groups_per_step=2, ahead=1,
                                   first_step=1, last_step=10)
        before = producer.resume_state(1)
        producer.start()
        await asyncio.sleep(0.05)  # steps 1 and 2 start
        at_step_2 = producer.resume_state(2)
        for step in (1, 2):
            await producer.next_group()
            await producer.next_group()
            await producer.reached(step)
        await asyncio.sleep(0.05)  # steps 3 and 4 start
        kept = sorted(producer._states_at_start)
        await producer.stop()
        return before, at_step_2, kept

    before, at_step_2, kept = asyncio.run(drive())
    assert before["rollouter"] == {"groups_started": 0, "rollouts_started": 0}
    assert at_step_2["rollouter"] == {"groups_started": 2, "rollouts_started": 8}
    assert at_step_2["samples"] != before["samples"]
    assert kept == [3, 4]  # bounded: the steps started but not yet reached


class _Router:
    """The router's `stats` endpoint, with no replica."""

    class stats:  # noqa: N801 - stands in for an endpoint
        @staticmethod
        async def call_one():
            return {"replicas": [], "states": {"starting": 0, "serving": 0, "awaiting_weights": 0, "dead": 0},
                    "retries": 0, "restarts": 0, "weight_groups": 0}


def test_no_rollout_runs_after_train_returns_even_after_a_group_failed(tmp_path):
    config = load_config(None, ['model.path="/nonexistent"', f'controller.run_dir="{tmp_path}"',
                                "rollout.prompts_per_step=2", "controller.mode=async", "controller.max_staleness=1"])
    controller = Controller(config)

    class Rollouter:
        started, cancelled = 0, 0

        async def run_group(self, sample):
            self.started += 1
            if sample["id"] == 0:
                raise RuntimeError("a bug in the group")
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise

        def state_dict(self):
            return {}

    class InOrder:
        taken = 0

        def next(self, n):
            self.taken += n
            return [{"id": i} for i in range(self.taken - n, self.taken)]

        def state_dict(self):
            return {"taken": self.taken}

    controller.samples, controller.rollouter, controller.router = InOrder(), Rollouter(), _Router()

    async def main():
        failed = r"^step 1: a rollout group failed: RuntimeError\('a bug in the group'\)"
        with pytest.raises(TrainingError, match=failed):
            await controller.train()
        return others()

    assert asyncio.run(main()) == []
    # Steps 1 and 2 started (max_staleness 1): one group failed, the 3 others were cancelled.
    assert controller.rollouter.started == 4 and controller.rollouter.cancelled == 3
