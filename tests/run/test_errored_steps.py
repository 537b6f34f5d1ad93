"""The controller stops a run after controller.max_errored_steps steps in a row in which every
rollout ended in an error, saved and naming the error; a step with one good rollout resets the
count. The controller's collaborators (trainer, router, weight sync, producer) are stand-ins:
what is under test is its step loop's bookkeeping, not the procs (a real run: docs/agent_gateway_notes.md)."""

from __future__ import annotations

import asyncio
import time

import pytest

from rlactors.config import load_config
from rlactors.rollout.types import Rollout, RolloutGroup, RolloutStatus
from rlactors.run.controller import Controller
from rlactors.run.metrics import EnvErrorLog, MetricsLogger
from rlactors.run.run_dir import TrainingError

STATS = {"states": {"serving": 1, "dead": 0}, "retries": 0, "restarts": 0, "weight_groups": 1,
         "replicas": [{"engine": None}], "restarting": 0}


class Stub:
    """Answers every awaited call the controller makes in a step without training."""

    async def reached(self, step):
        pass

    async def due(self, version):
        return False


def group(ok: bool) -> RolloutGroup:
    status = RolloutStatus.COMPLETED if ok else RolloutStatus.ERROR_ENV
    rollouts = [Rollout(group_id="g0", index=i, session_id=f"g0/{i}", seed=0, sample={}, status=status,
                        error=None if ok else "env run raised BadRequestError: tools[0]: 400") for i in range(2)]
    return RolloutGroup("g0", {}, rollouts, zero_variance=True, dropped=True, episodes=[])


@pytest.mark.parametrize("limit, steps_ok, stops_after", [
    (2, [False, False, True], 2),
    (3, [False, False, True, False, False, False], 6),  # a step with a good rollout starts the count again
    (0, [False] * 4, None),  # 0: never stops
])
def test_a_run_stops_after_max_errored_steps_in_a_row(tmp_path, capsys, limit, steps_ok, stops_after):
    config = load_config(overrides=['model.path="unused"', f'controller.run_dir="{tmp_path}"',
                                    f"controller.max_errored_steps={limit}", "controller.steps=10",
                                    "controller.log_samples=false"])
    controller = Controller(config)
    controller._env_errors = EnvErrorLog(tmp_path)
    controller.weight_sync = controller.producer = Stub()
    saved = []

    async def router_stats(router):
        return STATS

    async def save_step_once():
        saved.append(controller.step)
        return f"the state after step {controller.step} is saved in {tmp_path}"

    controller.meshes.router_stats = router_stats
    controller._save_step_once = save_step_once
    log = MetricsLogger(tmp_path, 10, tensorboard=False)

    async def steps():
        for step, ok in enumerate(steps_ok, start=1):
            await controller._finish_step(step, [group(ok)], time.perf_counter(), 0.0, log)

    if stops_after is None:
        asyncio.run(steps())
        assert saved == []
        return
    with pytest.raises(TrainingError) as error:
        asyncio.run(steps())
    first = stops_after - limit + 1
    assert str(error.value) == (
        f"steps {first}-{stops_after}: every rollout ended in an error, so nothing was trained ({limit} such steps "
        f"in a row, controller.max_errored_steps={limit}); the last step's: error_env: env run raised "
        f"BadRequestError: tools[0]: 400 (2 of 2 rollouts); the state after step {stops_after} is saved in {tmp_path}")
    assert saved == [stops_after] and controller.step == stops_after
    assert "trained nothing: every rollout ended in an error, e.g. error_env" in capsys.readouterr().out
