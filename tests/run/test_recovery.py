"""rlactors.run.recovery without procs: how many trainer restarts a run makes, what stops it after
them, and which checkpoint a rebuilt trainer starts from."""

from __future__ import annotations

import asyncio
import json

from rlactors.run.recovery import TrainerLost, TrainerRestarts, recovery_point, train_with_restarts
from rlactors.run.run_dir import CONTROLLER_STATE, ResumeState, RunDir, TrainingError
from rlactors.trainer.checkpoint import COMPLETE_FILE, STATE_FILE, checkpoint_dir, partial_dir

LOST = "trainer rank 1 (pid 7) exited (signal 9)"


def test_restarts_are_counted_up_to_the_limit_and_only_for_a_lost_trainer_rank():
    restarts = TrainerRestarts(2)
    stopped = "step 5: {}; continue with --resume".format
    router = restarts.failure("the router's proc exited", None, stopped)  # not a trainer rank's death
    assert type(router) is TrainingError and str(router) == (
        "step 5: the router's proc exited (the trainer was restarted 0 times already, controller.restart_trainer=2); "
        "continue with --resume")
    for _ in range(2):
        lost = restarts.failure(LOST, LOST, stopped)
        assert type(lost) is TrainerLost and str(lost) == LOST
    last = restarts.failure(LOST, LOST, stopped)
    assert type(last) is TrainingError and restarts.done == 2
    assert str(last) == f"step 5: {LOST} (the trainer was restarted 2 times already, controller.restart_trainer=2); " \
                        "continue with --resume"
    off = TrainerRestarts(0)  # the default: the run stops with the cause alone, as before
    assert str(off.failure(LOST, LOST, stopped)) == stopped(LOST) and off.done == 0


def test_a_lost_trainer_is_rebuilt_and_the_steps_after_its_checkpoint_are_trained_again():
    attempts, recovered = [], []

    async def train(history):
        attempts.append(sorted(history))
        start = max(history, default=0) + 1
        for step in range(start, 7):
            history[step] = {"step": float(step), "attempt": float(len(attempts))}
            if step == 5 and len(attempts) == 1:
                raise TrainerLost(LOST)

    async def recover(cause):
        recovered.append(cause)
        return 3  # the checkpoint's step

    metrics = asyncio.run(train_with_restarts(train, recover))
    assert recovered == [LOST] and attempts == [[], [1, 2, 3]]
    assert [(m["step"], m["attempt"]) for m in metrics] == [(1, 1), (2, 1), (3, 1), (4, 2), (5, 2), (6, 2)]


def _checkpoint(root, step: int, complete: bool = True):
    path = checkpoint_dir(root, step)
    path.mkdir(parents=True)
    (path / STATE_FILE).write_text(json.dumps({"step": step}))
    state = ResumeState(step, step + 10, {"epoch": step}, {"groups": 2 * step})
    (path / CONTROLLER_STATE).write_text(state.files()[CONTROLLER_STATE])
    if complete:
        (path / COMPLETE_FILE).write_text("")
    return path, state


def test_a_rebuilt_trainer_starts_from_the_last_complete_checkpoint_else_from_the_start(tmp_path):
    run_dir = RunDir(tmp_path)
    start = ResumeState(0, 0, {"epoch": 0}, {"groups": 0})
    point = recovery_point(run_dir, start)
    assert (point.checkpoint, point.state, point.name) == (None, start, "model.path (no checkpoint yet)")

    _checkpoint(run_dir.checkpoints, 2)
    last, state = _checkpoint(run_dir.checkpoints, 4)
    _checkpoint(run_dir.checkpoints, 6, complete=False)  # a save the death cut short
    partial_dir(run_dir.checkpoints, 8).mkdir()
    point = recovery_point(run_dir, start)
    assert (point.checkpoint, point.state, point.name) == (last, state, str(last))
    restarts = TrainerRestarts(3)
    assert restarts.allow(LOST)
    assert restarts.recovered_line(7, LOST, point, 12.34) == (
        f"step 7: {LOST}; the trainer was rebuilt from {last} in 12.3 s (restart 1 of "
        "controller.restart_trainer=3); training again from step 5")
