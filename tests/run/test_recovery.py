"""rlactors.run.recovery without procs: how many trainer restarts a run makes, what stops it after
them, and which checkpoint a rebuilt trainer starts from."""

from __future__ import annotations

import json

from rlactors.run.recovery import TrainerRestarts, recovery_point
from rlactors.run.run_dir import CONTROLLER_STATE, ResumeState, RunDir
from rlactors.trainer.checkpoint import COMPLETE_FILE, STATE_FILE, checkpoint_dir, partial_dir

LOST = "trainer rank 1 (pid 7) exited (signal 9)"


def test_restarts_are_counted_up_to_the_limit_and_only_for_a_lost_trainer_rank():
    restarts = TrainerRestarts(2)
    assert not restarts.allow(None)  # not a trainer rank's death (the router's, the hosts')
    assert restarts.allow(LOST) and restarts.allow(LOST)
    assert not restarts.allow(LOST) and restarts.done == 2
    assert restarts.exhausted(LOST) == (f"{LOST} (the trainer was restarted 2 times already, "
                                        "controller.restart_trainer=2)")
    off = TrainerRestarts(0)  # the default: the run stops with the cause alone, as before
    assert not off.allow(LOST) and off.exhausted(LOST) == LOST


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
