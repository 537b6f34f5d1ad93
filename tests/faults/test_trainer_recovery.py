"""In-job trainer recovery (`controller.restart_trainer`, rlactors.run.recovery) through the real
Controller with real Monarch procs on CPU: a trainer rank SIGKILLed twice, before and after the
first checkpoint, is rebuilt each time; the steps since the checkpoint are trained again exactly
as they were the first time, every step is recorded once, and the run completes. (The counting of
restarts and the choice of checkpoint: tests/run/test_recovery.py.)"""

from __future__ import annotations

import asyncio
import json

import pytest
from faultkit import TrainerKilledAsStepsBegin, small_run_overrides

from rlactors.config import load_config
from rlactors.run.metrics import read_metrics
from rlactors.run.run_dir import SAMPLES_FILE

COMPARED = ("loss/loss", "loss/tokens", "train/grad_norm", "rollout/reward_mean")


@pytest.mark.slow
def test_a_trainer_killed_twice_is_rebuilt_from_its_checkpoints_and_every_step_is_recorded_once(
        tiny_ckpt, tmp_path, capsys, fault_record):
    config = load_config(None, small_run_overrides(
        tiny_ckpt, tmp_path, "controller.steps=4", "controller.checkpoint_every=2", "controller.restart_trainer=2",
        "controller.log_samples=true"))
    controller = TrainerKilledAsStepsBegin(config, kill_at=(2, 4))
    history = asyncio.run(asyncio.wait_for(controller.run(), 300))
    out = capsys.readouterr().out
    assert len(history) == 4  # the steps redone replace their first attempts

    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    samples = [json.loads(line)["step"] for line in (tmp_path / SAMPLES_FILE).read_text().splitlines()]
    assert samples == sorted(samples) and {s: samples.count(s) for s in set(samples)} == {s: 4 for s in (1, 2, 3, 4)}
    # Step 1 was trained before the first kill and again from model.path, step 3 before the second
    # and again from checkpoint 2: the same rollouts and updates both times.
    (before_first, _), (before_second, _) = controller.killed[2], controller.killed[4]
    assert [r["step"] for r in before_first] == [1] and [r["step"] for r in before_second] == [1, 2, 3]
    for first, again in ((before_first[0], records[0]), (before_second[2], records[2])):
        for key in COMPARED:
            assert again[key] == pytest.approx(first[key], rel=1e-5, abs=1e-7), (first["step"], key)

    lines = [line for line in out.splitlines() if "the trainer was rebuilt" in line]
    assert len(lines) == 2, out[-3000:]
    assert lines[0].startswith("step 2: trainer rank 0 (pid ") and " exited (signal 9); the trainer was rebuilt " \
        "from model.path (no checkpoint yet) in " in lines[0] and lines[0].endswith(
        "(restart 1 of controller.restart_trainer=2); training again from step 1"), lines[0]
    checkpoint = tmp_path / "checkpoints" / "step_00000002"
    assert f"the trainer was rebuilt from {checkpoint} in " in lines[1] and lines[1].endswith(
        "(restart 2 of controller.restart_trainer=2); training again from step 3"), lines[1]
    kills = [at for _, at in controller.killed.values()]
    training_again = [round(after - kill, 2) for kill, after in zip(kills, controller.stepped_at)]
    fault_record("trainer rank SIGKILLed twice (controller.restart_trainer=2)",
                 "trainer rank 0's proc as step 2 begins (no checkpoint yet) and as step 4 begins (after checkpoint 2)",
                 None, "nothing: steps 1 and 3 trained again, identical to their first attempts; 4/4 steps recorded "
                 "once; the run completed", kill_to_rebuilt_s=controller.rebuilt_at[0] - kills[0],
                 kill_to_rebuilt_2_s=controller.rebuilt_at[1] - kills[1], kill_to_a_step_again_s=training_again[0],
                 kill_to_a_step_again_2_s=training_again[1])
