"""Steps with nothing to train on, through the real controller with real Monarch procs on CPU: a
task whose groups never vary (every rollout earns the same reward, so GRPO drops every group)
must neither hang the run nor pass unnoticed. Each such step is a whole step (logged, counted,
checkpointed, resumable); the run finishes and says why nothing trained and what to try; and
in async mode the producer goes on past untrained steps, so training starts once groups vary."""

from __future__ import annotations

import asyncio
import json

import pytest
from faultkit import run_cli, small_run_overrides

from rlactors.config import load_config
from rlactors.rollout.producer import RolloutProducer
from rlactors.run.controller import Controller
from rlactors.run.metrics import NO_SIGNAL_HINT, read_metrics
from rlactors.trainer.checkpoint import checkpoint_dir, is_complete

NO_SIGNAL = ("rollout.keep_zero_variance_groups=false", "env.args={ signal_from_group = 1000000 }")
UNTRAINED_LINE = "trained nothing: equal rewards in each of its 2 groups"


def _state(run_dir, step):
    path = checkpoint_dir(run_dir / "checkpoints", step)
    assert is_complete(path), path
    return json.loads((path / "controller_state.json").read_text())


def test_a_run_whose_groups_never_vary_finishes_says_what_to_try_and_resumes(tiny_ckpt, tmp_path):
    overrides = small_run_overrides(tiny_ckpt, tmp_path, *NO_SIGNAL, "controller.steps=2")
    done = run_cli(*overrides, timeout=180)  # the old loop waited for ever for policy version 1 here
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    step_lines = [line for line in out.splitlines() if line.startswith("step ") and "/2 [" in line]
    assert len(step_lines) == 2 and all(UNTRAINED_LINE in line for line in step_lines), out
    # The hint comes once, at the first such step; the run's last line says why and what to try.
    assert out.count("GRPO has nothing to learn from. The run goes on") == 1
    assert "done: 2 steps, reward 0.000 over step 1 -> 0.000 over step 2; 2 of them trained nothing" in out
    assert out.rstrip().splitlines()[-1] == ("no step trained: the rollouts of each group earned equal rewards, so "
                                             f"GRPO had nothing to learn from; {NO_SIGNAL_HINT}")
    records = read_metrics(tmp_path)
    assert [(r["step"], r["train/trained"], r["policy/version"]) for r in records] == [(1, 0.0, 0.0), (2, 0.0, 0.0)]
    assert all(r["rollout/groups_dropped"] == 2 and r["rollout/episodes"] == 0 for r in records)
    assert "loss/loss" not in records[0]
    # Checkpointed as due (controller.checkpoint_every=1), at policy version 0.
    assert [(_state(tmp_path, s)["step"], _state(tmp_path, s)["policy_version"]) for s in (1, 2)] == [(1, 0), (2, 0)]

    done = run_cli("--resume", *overrides, "controller.steps=3", timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert f"resumed from {checkpoint_dir(tmp_path / 'checkpoints', 2)} at step 2 (policy version 0)" in out
    # The last line speaks for the whole run, and says which part this session trained.
    assert (f"done: 3 steps (1 in this session, resumed after step 2), reward 0.000 over step 1 -> 0.000 over step 3; "
            f"3 of them trained nothing (see their step lines); run dir {tmp_path}") in out
    assert [(r["step"], r["train/trained"]) for r in read_metrics(tmp_path)] == [(1, 0.0), (2, 0.0), (3, 0.0)]
    assert _state(tmp_path, 3)["policy_version"] == 0


def test_async_generation_goes_on_past_untrained_steps_and_trains_once_groups_vary(tiny_ckpt, tmp_path, capsys):
    # max_staleness 1: steps 1 and 2 generate groups g0-g3 at once, all without signal; step 3's
    # groups start once step 1 is done (which trained nothing and pushed nothing), step 4's once
    # step 2 is done.
    config = load_config(None, small_run_overrides(
        tiny_ckpt, tmp_path, "rollout.keep_zero_variance_groups=false", "env.args={ signal_from_group = 4 }",
        "controller.mode=async", "controller.max_staleness=1", "controller.steps=4", "controller.checkpoint_every=0"))
    history = asyncio.run(asyncio.wait_for(Controller(config).run(), 120))  # a regression hangs: fail instead
    assert [m["train/trained"] for m in history] == [0.0, 0.0, 1.0, 1.0]
    assert [m["policy/version"] for m in history] == [0.0, 0.0, 1.0, 2.0]
    assert [m["rollout/groups_dropped"] for m in history] == [2.0, 2.0, 0.0, 0.0]
    assert all(m["policy/age_max"] <= 1 and m["policy/stale_episodes_dropped"] == 0 for m in history)
    assert history[2]["loss/tokens"] > 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ") and "/4 [" in line]
    assert [UNTRAINED_LINE in line for line in lines] == [True, True, False, False]
    assert _state(tmp_path, 4)["policy_version"] == 2


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_producer_waits_for_the_step_before_not_for_a_policy_version(mode):
    """The producer's rule on its own: step s's groups start once the generators hold the policy
    of step s - 1 - ahead, whatever its version number."""
    config = load_config(None, ['model.path="/nonexistent"', 'controller.run_dir="/nonexistent"',
                                f"controller.mode={mode}"])
    started = []

    class Samples:
        steps_started = 0

        def next(self, n):
            self.steps_started += 1
            return list(range(n))

        def state_dict(self):
            return {}

    class Rollouter:
        async def run_group(self, sample):
            return sample

        def state_dict(self):
            return {}

    ahead = 0 if mode == "sync" else config.controller.max_staleness
    samples = Samples()
    producer = RolloutProducer(Rollouter(), samples, config.rollout.prompts_per_step, ahead, first_step=1,
                               last_step=config.controller.steps)

    async def drive():
        producer.start()
        for step in range(1, 4):
            await asyncio.sleep(0.05)
            started.append(list(range(1, samples.steps_started + 1)))
            await producer.reached(step)  # an untrained step: no policy version is pushed
        await producer.stop()

    asyncio.run(drive())
    if mode == "sync":
        assert started == [[1], [1, 2], [1, 2, 3]]
    else:
        assert started == [[1, 2], [1, 2, 3], [1, 2, 3, 4]]
