"""Training-side faults through the real controller (run.py in a subprocess, or the Controller in
this process), with real Monarch procs on CPU: env failures counted in the step metrics and
reported with their tracebacks, Ctrl-C saving the last completed step, the
trainer proc SIGKILLed mid-run then `--resume` matching an uninterrupted run, a half-written
checkpoint never picked, non-finite generator logprobs excluded, a non-finite loss that stops
the run with its state saved, corrupted weights on their way to the replicas, and with weights by
broadcast, a version the replicas refuse and a dead replica, between syncs or during a broadcast
(restarted into a new group; the run goes on); by messages, the last replica dead for good (the
run stops)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import shutil
import signal
import time

import pytest
import torch
from faultkit import (
    CliProcess,
    TrainerOutOfMemoryAtStep,
    kill_replica,
    run_cli,
    small_run_overrides,
    wait_until,
)
from support.stand_ins import ActorWith

from rlactors.config import load_config
from rlactors.run.controller import Controller, TrainingError
from rlactors.run.metrics import read_metrics
from rlactors.run.run_dir import RunDir
from rlactors.trainer.checkpoint import COMPLETE_FILE, checkpoint_dir, partial_dir
from rlactors.weight_sync import sync
from rlactors.weight_sync.shared import map_buffer

# FaultyEnv's schedule (see fault_envs.py): per step, 2 groups of 4 rollouts, of which 3 end in
# error_env, 1 in error_timeout, 2 in error_parse, and 2 have no fault.
FAULTS = ["env.args={ faults = true, hang_s = 60.0, stop_tokens = 96 }", "rollout.group_size=4",
          "rollout.step_timeout_s=1.0", "rollout.error_reward=-1.0", "controller.log_samples=true"]
COMPARED = ("loss/loss", "loss/tokens", "train/grad_norm", "loss/entropy/mean", "rollout/reward_mean")


@pytest.fixture(scope="module")
def reference_cli(tiny_ckpt, tmp_path_factory):
    """An uninterrupted 3-step run with env faults: its run dir and the finished CLI process."""
    run_dir = tmp_path_factory.mktemp("reference")
    done = run_cli(*small_run_overrides(tiny_ckpt, run_dir, *FAULTS))
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir, done


@pytest.fixture(scope="module")
def reference_run(reference_cli):
    """The step metrics of the uninterrupted 3-step run with env faults."""
    return read_metrics(reference_cli[0])


def test_env_failures_are_counted_in_step_metrics_and_lose_no_group(reference_run, fault_record):
    assert [m["step"] for m in reference_run] == [1, 2, 3]
    for m in reference_run:
        assert m["rollout/groups"] == 2 and m["rollout/rollouts"] == 8 and m["rollout/groups_dropped"] == 0
        assert m["rollout/status/error_env"] == 3  # step raised (1), reward function raised (2)
        assert m["rollout/status/error_timeout"] == 1  # step hung past step_timeout_s
        assert m["rollout/status/error_parse"] == 2  # garbage StepResult (1), NaN reward (1)
        assert m["rollout/status/completed"] + m["rollout/status/truncated_length"] == 2
        assert m["rollout/reward_min"] == -1.0 and math.isfinite(m["rollout/reward_mean"])
        assert m["policy/version"] == m["step"] and m["loss/tokens"] > 0 and math.isfinite(m["loss/loss"])
        assert m["train/update_skipped"] == 0
    for what, count in (("env step raised", 1), ("env step hung past step_timeout_s=1 s", 1),
                        ("env step returned garbage", 1), ("env step returned a NaN reward", 1),
                        ("reward function raised", 2)):
        fault_record("env failure", f"{what}, in {count} of 8 rollouts of every step", None,
                     "nothing: the rollout is marked (error_* status, error_reward) and trained on; every "
                     "group of every step trained; counts in rollout/status/* of each step")


def test_env_errors_are_reported_with_their_tracebacks(reference_cli, fault_record):
    run_dir, done = reference_cli
    log_file = run_dir / "env_errors.log"
    log = log_file.read_text()
    # Every env error of the 3 steps, each with its message (and where the env raised, its traceback).
    headers = [line for line in log.splitlines() if line.startswith("env error in step ")]
    assert len(headers) == 3 * 6
    assert sum("(error_env): env step raised RuntimeError: injected env failure in g" in h for h in headers) == 3
    assert sum("(error_env): env rubric.score raised ValueError: injected reward-function" in h for h in headers) == 6
    assert sum("(error_timeout): env step ran past step_timeout_s=1.0" in h for h in headers) == 3
    assert sum("(error_parse): env step: step must return a StepResult, got str" in h for h in headers) == 3
    assert sum("(error_parse): env step: reward components must be" in h for h in headers) == 3
    raised = log.split("env error in step 1, rollout g0/0 (error_env)")[1]
    assert 'fault_envs.py", line' in raised and 'raise RuntimeError(f"injected env failure in ' in raised

    # The console: the first error of each of the first 3 kinds with its traceback, then one line
    # for the other kinds; each step line counts its env errors.
    out = done.stdout
    printed = [line for line in out.splitlines() if line.startswith("env error in step ")]
    assert printed == [
        "env error in step 1, rollout g0/0 (error_env): env step raised RuntimeError: injected env failure in g0/0/t0",
        "env error in step 1, rollout g0/1 (error_parse): env step: step must return a StepResult, got str",
        "env error in step 1, rollout g0/2 (error_env): env rubric.score raised ValueError: injected reward-function "
        "failure in g0/2"], out
    assert "RuntimeError: injected env failure in g0/0/t0" in out.split(printed[0])[1].split(printed[1])[0]
    assert 'fault_envs.py", line' in out.split(printed[0])[1].split(printed[1])[0]
    assert f"env errors of more kinds in step 1: see {log_file}" in out
    step_lines = [line for line in out.splitlines() if line.startswith("step ") and "/3 [" in line]
    assert len(step_lines) == 3 and all("env errors 6/8" in line for line in step_lines), out

    # samples.jsonl: every rollout that ended in an error, with its message, and each turn's prompt.
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    errors = [s for s in samples if s["status"].startswith("error_")]
    assert len(errors) == 3 * 6 and all(s["error"] for s in errors)
    assert {s["error"] for s in errors if s["step"] == 1 and s["group"] == "g0" and s["rollout"] == 0} == \
        {"env step raised RuntimeError: injected env failure in g0/0/t0"}
    assert all(s["error"] is None for s in samples if not s["status"].startswith("error_"))
    assert all(s["turns"][0]["prompt"] and "completion" in s["turns"][0] for s in samples)
    fault_record("env failure, reported", "an env whose step raises, hangs or returns garbage and whose reward "
                 "function raises, in 6 of 8 rollouts of every step", None,
                 "nothing; every error with its message and traceback in env_errors.log, the first of 3 kinds on "
                 "the console, the message in samples.jsonl, the count on each step line")


def test_ctrl_c_saves_the_last_completed_step_and_resume_matches_an_uninterrupted_run(
        tiny_ckpt, tmp_path, reference_run, fault_record):
    run_dir = tmp_path / "run"
    overrides = small_run_overrides(tiny_ckpt, run_dir, *FAULTS, "controller.checkpoint_every=0")
    cli = CliProcess(*overrides, "controller.steps=50", new_session=True)
    metrics_file = run_dir / "metrics.jsonl"
    wait_until(lambda: (metrics_file.is_file() and metrics_file.read_text().endswith("\n"))
               or cli.proc.poll() is not None, 120, what="step 1's metrics")
    # Step 1 is logged, not checkpointed (checkpoint_every=0); step 2 takes >= 1 s (a rollout hangs
    # until step_timeout_s). Ctrl-C as a terminal sends it: to the process group.
    interrupted_at = time.monotonic()
    cli.interrupt()
    code = cli.wait()
    stopped_s = time.monotonic() - interrupted_at
    stderr = cli.text("stderr")
    assert code == 130 and "Traceback" not in stderr, stderr[-3000:]
    steps = [m["step"] for m in read_metrics(run_dir)]
    last = steps[-1]  # 2 if step 2's update had begun: it completes first
    assert steps == list(range(1, last + 1)) and last in (1, 2), steps
    saved = checkpoint_dir(run_dir / "checkpoints", last)
    assert f"interrupted: saving step {last}" in stderr
    assert stderr.strip().splitlines()[-1] == \
        f"interrupted after step {last}: the run is saved in {saved}; continue with --resume"
    assert (saved / COMPLETE_FILE).is_file()

    resumed = run_cli("--resume", *overrides)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {saved} at step {last}" in resumed.stdout
    after = read_metrics(run_dir)
    assert [m["step"] for m in after] == [1, 2, 3]
    for ours, theirs in zip(after, reference_run):
        for key in COMPARED:
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-7), (ours["step"], key)
    fault_record("Ctrl-C", f"SIGINT to the run's process group after step {last} was logged, before any "
                 "checkpoint (controller.checkpoint_every=0)", None,
                 f"the rollouts of step {last + 1} only: step {last} was saved on the way out "
                 f"({stopped_s:.1f} s to exit); --resume matched the uninterrupted run (rel 1e-5)")


def test_ctrl_c_before_the_first_step_says_nothing_is_saved_and_the_dir_takes_a_new_run(tiny_ckpt, tmp_path):
    # What a run stopped before its first step leaves: its config.toml and an empty metrics.jsonl.
    (tmp_path / "config.toml").write_text("[controller]\n")
    (tmp_path / "metrics.jsonl").write_text("")
    config = load_config(None, small_run_overrides(tiny_ckpt, tmp_path))
    controller = Controller(config)
    asyncio.run(controller.keep_last_step())  # what run() does when cancelled; no proc is needed at step 0
    assert controller.interrupt_report == ("interrupted before step 1 completed: nothing is saved; start the run "
                                           "again (without --resume)")
    assert RunDir(tmp_path).check(config, resume=False) is None  # nothing to lose: a new run may start there


def _trainer_pid(cli: CliProcess) -> int:
    """Trainer rank 0's process, as the run's placement line names it."""
    return int(re.search(r"trainer ranks on [^ ]+ \(pid (\d+)\)", cli.text("stdout")).group(1))


def test_trainer_killed_in_step_2_stops_cleanly_and_resume_matches_an_uninterrupted_run(
        tiny_ckpt, tmp_path, reference_run, fault_record):
    run_dir = tmp_path / "run"
    overrides = small_run_overrides(tiny_ckpt, run_dir, *FAULTS)
    cli = CliProcess(*overrides)
    first = checkpoint_dir(run_dir / "checkpoints", 1)
    metrics_file = run_dir / "metrics.jsonl"
    wait_until(lambda: (metrics_file.is_file() and metrics_file.read_text().endswith("\n"))
               or cli.proc.poll() is not None, 120, what="step 1's metrics")
    # Step 1 is checkpointed and logged; step 2 is under way (its rollouts take >= 1 s: one hangs
    # until step_timeout_s).
    pid = _trainer_pid(cli)
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    code = cli.wait()
    stopped_s = time.monotonic() - killed_at
    stderr = cli.text("stderr")
    assert code == 2, stderr[-3000:]
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    trainer = f"trainer rank 0 (pid {pid})"
    assert last.startswith(f"error: step 2: {trainer} exited (signal 9); ") and "--resume" in last, last
    detected = cli.first_line_after("stderr", killed_at, f"{trainer} exited")
    detection_s = None if detected is None else detected - killed_at
    assert detection_s is not None and detection_s < 2.0, stderr[-3000:]
    assert [m["step"] for m in read_metrics(run_dir)] == [1]
    assert not checkpoint_dir(run_dir / "checkpoints", 2).exists()

    # A save of step 2 cut off mid-write, as a crash leaves it: the hidden partial dir, and a
    # step dir holding every file but COMPLETE (a torn rename); resume must not pick either.
    partial = partial_dir(run_dir / "checkpoints", 2)
    shutil.copytree(first, partial)
    torn = checkpoint_dir(run_dir / "checkpoints", 2)
    shutil.copytree(first, torn)
    (torn / COMPLETE_FILE).unlink()
    with open(next((torn / "dcp").iterdir()), "r+b") as f:
        f.truncate(7)

    resumed = run_cli("--resume", *overrides)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {first} at step 1" in resumed.stdout
    after = read_metrics(run_dir)
    assert [m["step"] for m in after] == [1, 2, 3]
    for ours, theirs in zip(after, reference_run):
        for key in COMPARED:
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-7), (ours["step"], key)
    fault_record("trainer proc killed mid-run (step 2)",
                 "SIGKILL of the trainer proc during step 2 (after checkpoint 1), then a torn step-2 "
                 "checkpoint planted (partial dir + step dir without COMPLETE, truncated DCP file)",
                 detection_s, "step 2's rollouts (regenerated identically after --resume from checkpoint 1); "
                 "losses of steps 2-3 equal the uninterrupted run's (rel 1e-5)",
                 controller_exit_s=stopped_s)


def _ids(request_id: str) -> tuple[int, int]:
    group, index, _turn = request_id.split("/")
    return int(group[1:]), int(index)


class CorruptingController(Controller):
    """Corrupts the generator's logprobs on their way to the rollouts (the real engine runs): one
    NaN and one -inf logprob in rollout 0 of each group of step 1 (groups 0 and 1); with
    `shift_step2`, every logprob of step 2 lowered by 1 (the trainer/generator ratio becomes e,
    outside the clip range)."""

    shift_step2 = False
    saves = 0

    async def save_checkpoint(self):
        self.saves += 1
        return await super().save_checkpoint()

    async def generate(self, prompt_token_ids, sampling, request_id, session_id=None):
        completion = await super().generate(prompt_token_ids, sampling, request_id, session_id)
        group, index = _ids(request_id)
        if group < 2 and index == 0:
            completion.logprobs[0], completion.logprobs[1] = float("nan"), float("-inf")
        elif group >= 2 and self.shift_step2:
            completion.logprobs = [lp - 1.0 for lp in completion.logprobs]
        return completion


@pytest.mark.parametrize("overflow,weight_sync", [("loss", "messages"), ("gradient", "messages"),
                                                  ("gradient", "broadcast")])
def test_nonfinite_logprobs_are_excluded_and_a_nonfinite_step_stops_with_the_state_saved(
        tiny_ckpt, tmp_path, fault_record, overflow, weight_sync):
    # Step 2: rollout 0 of each group earns a finite but absurd reward x; Dr.GRPO advantages
    # (reward - group mean) are then +-x/2. x = 1.7e38 (about the largest reward allowed) with a
    # ratio of e: rollout 1's per-token losses (x/2) * e sum past fp32, so the loss is inf or NaN.
    # x = 1e30: the loss stays finite but the gradient norm overflows and optim_step skips the
    # update; that must stop the run too. By broadcast, with no checkpoint due at step 2, step 2's
    # push went with its optimizer step: it sent the unchanged policy, which the replicas refused.
    reward = {"loss": 1.7e38, "gradient": 1e30}[overflow]
    by_weight_sync = {"messages": ['generator.weight_sync="messages"'],
                      "broadcast": [*BROADCAST, "controller.checkpoint_every=0"]}[weight_sync]
    config = load_config(None, small_run_overrides(
        tiny_ckpt, tmp_path, f"env.args={{ huge_reward = {reward}, huge_reward_from_group = 2 }}",
        'loss.name="dr_grpo"', 'rollout.advantage="dr_grpo"', *by_weight_sync))
    controller = CorruptingController(config)
    controller.shift_step2 = overflow == "loss"
    with pytest.raises(TrainingError) as raised:
        asyncio.run(controller.run())
    message = str(raised.value)
    assert message.startswith("step 2: the loss is ") and str(tmp_path / "checkpoints") in message
    loss = float(message.removeprefix("step 2: the loss is ").split()[0])
    assert math.isfinite(loss) == (overflow == "gradient"), message
    assert "(gradient norm nan)" in message or "(gradient norm inf)" in message, message
    # Step 1 trained without the 4 corrupted tokens, and counted them.
    (step1,) = read_metrics(tmp_path)
    assert step1["loss/nonfinite_logprob_tokens"] == 4 and math.isfinite(step1["loss/loss"])
    assert step1["loss/tokens"] == 4 * 8 - 4 and step1["policy/version"] == 1
    # The state after step 1 is saved and complete, controller state included; written once: at
    # step 1 (controller.checkpoint_every=1), not again over itself when step 2 failed, or (by
    # broadcast, no checkpoint due) when step 2 failed.
    assert controller.saves == 1
    saved = checkpoint_dir(tmp_path / "checkpoints", 1)
    assert (saved / COMPLETE_FILE).is_file() and not checkpoint_dir(tmp_path / "checkpoints", 2).exists()
    state = json.loads((saved / "controller_state.json").read_text())
    assert state["step"] == 1 and state["policy_version"] == 1
    if overflow == "loss":
        fault_record("non-finite generator logprobs", "a NaN and a -inf logprob in 2 of 4 rollouts of step 1",
                     None, "the 4 tokens only: excluded from the loss and its normalisation, counted in "
                     "loss/nonfinite_logprob_tokens; training went on")
    injected = {"loss": "a reward of 1.7e38 in 2 of 4 rollouts of step 2 and its generator logprobs lowered "
                        "by 1 (Dr.GRPO: the clipped loss terms overflow fp32)",
                "gradient": "a reward of 1e30 in 2 of 4 rollouts of step 2 (Dr.GRPO: the loss stays finite, "
                            "the gradient norm overflows; optim_step skips the update)"}[overflow]
    if weight_sync == "broadcast":
        injected += "; weights by broadcast, step 2's push sent with its optimizer step"
    fault_record(f"non-finite {overflow}" + (" (broadcast)" if weight_sync == "broadcast" else ""), injected, None,
                 f"step 2 only: the run stopped with `{message.replace(str(tmp_path), '<run_dir>')}`; "
                 "checkpoint 1 (complete) is the saved state")


class _StandIn:
    """Stands in front of one of the real router's endpoints: calls it with altered arguments,
    then records what the replicas hold (`after`)."""

    def __init__(self, endpoint, router):
        self.endpoint, self.router, self.after = endpoint, router, None

    async def _call(self, *args):
        try:
            return await self.endpoint.call_one(*args)
        finally:
            self.after = await self.router.stats.call_one()


class _CorruptingUpdates(_StandIn):
    """`update_weights`: flips one bit of one tensor of every weight push on its way to the
    replicas (after the trainer computed the checksum)."""

    async def call_one(self, version, weights, checksum, mode=None):
        name = "model.layers.0.mlp.up_proj.weight"
        flipped = weights[name].clone()
        flipped.view(-1).view(torch.int32)[7] ^= 1 << 3
        return await self._call(version, {**weights, name: flipped}, checksum, mode)


class CorruptedSyncController(Controller):
    async def start(self) -> None:
        await super().start()
        self.router = self.weight_sync.router = ActorWith(
            self.router, update_weights=_CorruptingUpdates(self.router.update_weights, self.router))


def test_corrupted_weight_sync_stops_the_run_and_the_replicas_keep_the_old_policy(tiny_ckpt, tmp_path, fault_record):
    config = load_config(None, small_run_overrides(tiny_ckpt, tmp_path))
    controller = CorruptedSyncController(config)
    with pytest.raises(TrainingError) as raised:
        asyncio.run(controller.run())
    message = str(raised.value)
    assert message.startswith("weight sync of policy version 1 failed: ") and "ChecksumMismatch" in message
    assert "rejected by replica 0" in message and "still serving version 0" in message
    replicas = controller.router.update_weights.after["replicas"]
    assert [(r["state"] == "serving", r["version"]) for r in replicas] == [(True, 0)]
    assert [m["step"] for m in read_metrics(tmp_path)] == []  # step 1 stopped at its weight push
    assert (checkpoint_dir(tmp_path / "checkpoints", 1) / COMPLETE_FILE).is_file()  # saved before the push
    fault_record("weight-sync corruption (controller)", "one bit flipped in one tensor of the step-1 push, "
                 "between the trainer (which computed the checksum) and the router", None,
                 f"no served token: the replica kept version 0; the run stopped with `{message}`; "
                 "checkpoint 1 (complete) resumes it")


# -- weights by broadcast (generator.weight_sync = "broadcast": a gloo group on CPU, NCCL on GPUs) --

BROADCAST = ("generator.replicas=2", 'generator.weight_sync="broadcast"')


class _OtherVersionReceives(_StandIn):
    """`receive_weights`: the replicas are told to expect another version than the one the
    trainer broadcasts (the checksum travels with the broadcast, so the corruption a test can make
    from outside the procs is the expected version; a flipped bit on the wire is
    tests/weight_sync/test_broadcast_group.py's)."""

    async def call_one(self, version, mode=None):
        return await self._call(version + 1, mode)


class OtherVersionBroadcastController(Controller):
    async def start(self) -> None:
        await super().start()
        self.router = self.weight_sync.router = ActorWith(
            self.router, receive_weights=_OtherVersionReceives(self.router.receive_weights, self.router))


def test_a_broadcast_the_replicas_refuse_stops_the_run_and_they_keep_the_old_policy(
        tiny_ckpt, tmp_path, fault_record):
    config = load_config(None, small_run_overrides(tiny_ckpt, tmp_path, *BROADCAST))
    controller = OtherVersionBroadcastController(config)
    with pytest.raises(TrainingError) as raised:
        asyncio.run(controller.run())
    message = str(raised.value)
    assert message.startswith("weight sync of policy version 1 failed: ") and "UnexpectedVersion" in message
    assert "weights version 2 expected, the broadcast carried version 1" in message
    assert "rejected by replica 0" in message and "replica 1" in message
    replicas = controller.router.receive_weights.after["replicas"]
    assert [(r["state"] == "serving", r["version"], r["engine"]["version"]) for r in replicas] == [(True, 0, 0)] * 2
    assert (checkpoint_dir(tmp_path / "checkpoints", 1) / COMPLETE_FILE).is_file()
    fault_record("weight-sync mismatch (broadcast)", "the replicas told to expect another version than "
                 "the step-1 broadcast carries", None, "no served token: both replicas kept version 0; the run "
                 f"stopped with `{message[:120]}...`; checkpoint 1 (complete) resumes it")


async def restarted_into_the_next_group(router) -> None:
    """Waits until replica 1's restart is up beside replica 0: both members of the next group."""
    up = time.monotonic()
    while (await router.plan_weight_group.call_one())["members"] != [0, 1]:
        assert time.monotonic() - up < 120, "replica 1 was not restarted"
        await asyncio.sleep(0.1)


class RecordingBroadcastSync(sync.BroadcastSync):
    """Records the members of every weight group formed."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.groups: list[list[int]] = []

    async def _form_group(self, plan):
        self.groups.append(plan["members"])
        await super()._form_group(plan)


class ReplicaKilledBeforeSync(Controller):
    """SIGKILLs replica 1's proc as step 1's optimizer step goes out, before its weight sync, and records how
    long the router took to count it dead; before step 2's sync it waits until the restarted
    replica is up. Records the router's stats after the last sync (and, through
    RecordingBroadcastSync, every weight group formed)."""

    async def push_weights(self, version):
        if version == 1:
            killed = await kill_replica(self.router, 1)
            while (await self.router.stats.call_one())["deaths"] != 1:
                assert time.monotonic() - killed < 30, "the router did not count replica 1 dead"
                await asyncio.sleep(0.05)
            self.detection_s = time.monotonic() - killed
            while self.weight_sync._group_current():  # the router's word reaches the push by its port
                assert time.monotonic() - killed < 30, "the push was not told that replica 1 died"
                await asyncio.sleep(0.01)
        if version == 2:
            await restarted_into_the_next_group(self.router)
        timings = await super().push_weights(version)
        await self.weight_sync.settled()  # the router has recorded the push
        self.router_stats = await self.router.stats.call_one()
        return timings


def test_a_dead_replica_in_a_broadcast_run_is_restarted_into_a_new_group_and_the_run_goes_on(
        tiny_ckpt, tmp_path, fault_record, monkeypatch):
    config = load_config(None, small_run_overrides(tiny_ckpt, tmp_path, *BROADCAST, "controller.steps=4",
                                                   "controller.checkpoint_every=0"))
    monkeypatch.setattr(sync, "BroadcastSync", RecordingBroadcastSync)
    controller = ReplicaKilledBeforeSync(config)
    metrics = asyncio.run(controller.run())
    controller.groups = controller.weight_sync.groups
    assert [m["policy/version"] for m in metrics] == [1.0, 2.0, 3.0, 4.0]
    # Formed at start; at sync 1 without replica 1 (or with its restart, if that was up already);
    # with the restarted replica once it was up.
    assert controller.groups in ([[0, 1], [0], [0, 1]], [[0, 1], [0, 1]]), controller.groups
    # Told of the death, each push formed its group before broadcasting: none broke.
    assert [m["weight_sync/broadcast_tries"] for m in metrics] == [1.0] * 4
    stats = controller.router_stats
    assert stats["weight_groups"] == len(controller.groups) and stats["restarts"] == 1 and stats["deaths"] == 1
    # Both replicas, the restarted one too, accepted the last broadcast and serve it.
    assert [(r["state"] == "serving", r["version"]) for r in stats["replicas"]] == [(True, 4), (True, 4)]
    assert stats["replicas"][1]["routed"] > 0 and stats["states"]["awaiting_weights"] == 0
    assert metrics[-1]["generator/serving_replicas"] == 2 and metrics[-1]["generator/restarts"] == 1
    fault_record("generator replica SIGKILLed (broadcast weight sync)",
                 "replica 1's proc, as step 1's optimizer step goes out, before its weight sync",
                 controller.detection_s,
                 f"nothing: the run went on; weight groups formed {controller.groups} (the restarted replica "
                 "joined the group formed once it was up, and served from the next broadcast on)")


class _KillingBroadcast:
    """The trainer's `send_weights`: the first call SIGKILLs replica 1, a member of the group
    formed for it, and broadcasts for real once the router has counted it dead (its process is
    gone: gloo fails the broadcast; a kill racing the first bytes lets gloo's sender finish a
    buffer this small, and the dead member only misses it); the later calls just broadcast."""

    def __init__(self, controller, send_weights):
        self.controller, self.send_weights = controller, send_weights

    async def call(self, version):
        if self.controller.killed_at is None:
            router = self.controller.router
            self.controller.killed_at = await kill_replica(router, 1)
            while (await router.stats.call_one())["deaths"] != 1:
                assert time.monotonic() - self.controller.killed_at < 30, "the router did not count replica 1 dead"
                await asyncio.sleep(0.05)
            self.controller.detection_s = time.monotonic() - self.controller.killed_at
        return await self.send_weights.call(version)


class ReplicaKilledDuringBroadcast(Controller):
    """SIGKILLs replica 1's proc as step 1's broadcast starts (`_KillingBroadcast`); before step 2's sync it waits
    until the restarted replica is up. Records when step 1's push returned and the router's
    stats after the last sync."""

    killed_at = None

    async def start(self) -> None:
        await super().start()
        self.trainer = self.weight_sync.trainer = ActorWith(
            self.trainer, send_weights=_KillingBroadcast(self, self.trainer.send_weights))

    async def push_weights(self, version):
        if version == 2:
            await restarted_into_the_next_group(self.router)
        timings = await super().push_weights(version)
        if version == 1:
            self.recovered_s = time.monotonic() - self.killed_at
        await self.weight_sync.settled()  # the router has recorded the push
        self.router_stats = await self.router.stats.call_one()
        return timings


def test_a_replica_killed_during_a_broadcast_with_restart_dead_re_forms_the_group_and_the_run_completes(
        tiny_ckpt, tmp_path, fault_record, monkeypatch):
    config = load_config(None, small_run_overrides(tiny_ckpt, tmp_path, *BROADCAST, "controller.checkpoint_every=0"))
    assert config.generator.restart_dead  # the default
    monkeypatch.setattr(sync, "BroadcastSync", RecordingBroadcastSync)
    controller = ReplicaKilledDuringBroadcast(config)
    metrics = asyncio.run(asyncio.wait_for(controller.run(), 240))  # a regression hangs: fail instead
    groups = controller.weight_sync.groups
    assert [m["policy/version"] for m in metrics] == [1.0, 2.0, 3.0]
    # Step 1's broadcast broke (gloo fails at once), so it went again to a group of the survivor,
    # formed at once (the restart takes seconds); the restarted replica joined the group of step 2's sync.
    assert [m["weight_sync/broadcast_tries"] for m in metrics] == [2.0, 1.0, 1.0]
    assert groups == [[0, 1], [0], [0, 1]], groups
    stats = controller.router_stats
    assert stats["deaths"] == 1 and stats["restarts"] == 1 and stats["weight_groups"] == 3
    assert [(r["state"], r["version"]) for r in stats["replicas"]] == [("serving", 3), ("serving", 3)]
    assert metrics[-1]["generator/serving_replicas"] == 2 and metrics[-1]["generator/restarts"] == 1
    fault_record("generator replica SIGKILLed during a broadcast (gloo, generator.restart_dead)",
                 "replica 1's proc, a member of the group formed for step 1's broadcast, as that broadcast "
                 "starts (once the router counted it dead)", controller.detection_s,
                 f"nothing: the broadcast broke, went again to a new group of the survivor "
                 f"{controller.recovered_s:.1f} s after the kill (step 1's push returned), and the restarted replica "
                 f"joined at step 2's sync; weight groups formed {groups}; 3/3 steps trained",
                 recovered_s=controller.recovered_s)


def test_a_replica_killed_during_a_broadcast_without_restart_dead_stops_the_run_naming_it(
        tiny_ckpt, tmp_path, fault_record, monkeypatch):
    # gloo fails the broadcast at once: the watch for a broadcast stuck on the dead member (as over
    # NCCL) must not fire first on a busy machine.
    monkeypatch.setattr(sync, "BROADCAST_DEATH_GRACE_S", 60.0)
    config = load_config(None, small_run_overrides(tiny_ckpt, tmp_path, *BROADCAST, "generator.restart_dead=false",
                                                   "controller.checkpoint_every=0"))
    controller = ReplicaKilledDuringBroadcast(config)
    with pytest.raises(TrainingError) as raised:
        asyncio.run(asyncio.wait_for(controller.run(), 240))  # a regression hangs: fail instead
    assert str(raised.value) == ("weight sync of policy version 1: generator replica(s) [1] died during the "
                                 "broadcast, which did not reach the members still up")
    assert read_metrics(tmp_path) == []  # step 1 stopped at its weight sync
    fault_record("generator replica SIGKILLed during a broadcast (gloo, no generator.restart_dead)",
                 "replica 1's proc, a member of the group formed for step 1's broadcast, as that broadcast "
                 "starts (once the router counted it dead)", controller.detection_s,
                 f"step 1's update: the run stopped with `{raised.value}`")


class OnlyReplicaKilledBeforeSync(Controller):
    """SIGKILLs the only replica (not restarted) as step 1's optimizer step goes out, before its weight sync."""

    async def push_weights(self, version):
        if version == 1:
            killed = await kill_replica(self.router, 0)
            while await self.router.dead_replicas.call_one() != [0]:
                assert time.monotonic() - killed < 30, "the router did not count replica 0 dead"
                await asyncio.sleep(0.05)
        return await super().push_weights(version)


def test_a_broadcast_run_with_no_replica_left_stops_with_the_step_saved(tiny_ckpt, tmp_path):
    config = load_config(None, small_run_overrides(tiny_ckpt, tmp_path, *BROADCAST, "generator.replicas=1",
                                                   "generator.restart_dead=false", "controller.checkpoint_every=0"))
    with pytest.raises(TrainingError) as raised:
        asyncio.run(OnlyReplicaKilledBeforeSync(config).run())
    assert str(raised.value) == ("no generator replica is up to receive the weights; the state after step 1 "
                                 f"is saved in {tmp_path / 'checkpoints'}")
    assert (checkpoint_dir(tmp_path / "checkpoints", 1) / COMPLETE_FILE).is_file()
    assert read_metrics(tmp_path) == []  # step 1 stopped at its weight sync


class OnlyReplicaKilledInStep2(Controller):
    """SIGKILLs the only replica as step 2's first request goes out."""

    killed_at = None

    async def generate(self, prompt_token_ids, sampling, request_id, session_id=None):
        if self.killed_at is None and request_id.startswith("g2/"):
            self.killed_at = await kill_replica(self.router, 0)
        return await super().generate(prompt_token_ids, sampling, request_id, session_id)


def test_a_messages_run_whose_last_replica_died_stops_with_the_step_saved(tiny_ckpt, tmp_path, fault_record):
    config = load_config(None, small_run_overrides(tiny_ckpt, tmp_path, 'generator.weight_sync="messages"',
                                                   "generator.restart_dead=false", "controller.checkpoint_every=0"))
    controller = OnlyReplicaKilledInStep2(config)
    with pytest.raises(TrainingError) as raised:  # before: steps 2 and 3 trained nothing, and the run "completed"
        asyncio.run(asyncio.wait_for(controller.run(), 120))
    assert str(raised.value) == ("step 2: every generator replica is dead (generator.restart_dead = false): no "
                                 f"rollout can be generated; the state after step 2 is saved in "
                                 f"{tmp_path / 'checkpoints'}; continue with --resume")
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    assert records[1]["generator/serving_replicas"] == 0 and records[1]["rollout/status/error_generator"] > 0
    assert (checkpoint_dir(tmp_path / "checkpoints", 2) / COMPLETE_FILE).is_file()
    fault_record("last generator replica SIGKILLed mid-rollout (messages, no generator.restart_dead)",
                 "the only replica's proc, at step 2's first request", None,
                 f"step 2's rollouts; the run stopped after step 2, saved: `{str(raised.value).split(';')[0]}`")


class _StuckBroadcast:
    """The trainer's `send_weights` as over NCCL with a dead member: replica 1 is SIGKILLed
    and the call never returns."""

    def __init__(self, controller):
        self.controller = controller

    async def _never(self):
        await asyncio.Event().wait()

    def call(self, version):
        async def kill_then_wait():
            self.controller.killed_at = await kill_replica(self.controller.router, 1)
            await self._never()
        return kill_then_wait()


class StuckBroadcastController(Controller):
    async def start(self) -> None:
        await super().start()
        self.trainer = self.weight_sync.trainer = ActorWith(self.trainer, send_weights=_StuckBroadcast(self))

    async def push_weights(self, version):
        try:
            return await super().push_weights(version)
        finally:
            self.given_up_at = time.monotonic()


def test_a_replica_dying_during_a_stuck_broadcast_stops_the_run_instead_of_hanging(tiny_ckpt, tmp_path, fault_record):
    config = load_config(None, small_run_overrides(tiny_ckpt, tmp_path, *BROADCAST, "generator.restart_dead=false",
                                                   "controller.checkpoint_every=0"))
    controller = StuckBroadcastController(config)
    with pytest.raises(TrainingError) as raised:
        asyncio.run(asyncio.wait_for(controller.run(), 120))  # a regression hangs: fail instead
    stopped_s = controller.given_up_at - controller.killed_at  # then the shutdown stops the procs
    assert str(raised.value) == ("weight sync of policy version 1: generator replica(s) [1] died during the "
                                 "broadcast, which waits for every member; no checkpoint was completed; "
                                 "continue with --resume")
    assert stopped_s < 10, stopped_s
    fault_record("generator replica SIGKILLed during a broadcast that waits for it (as NCCL does)",
                 "replica 1's proc, while step 1's broadcast is in flight (the trainer's side stood in by a "
                 "call that never returns)", None,
                 f"step 1's update: the sync gave up {stopped_s:.1f} s after the kill and the run stopped, naming "
                 "the dead replica and the last checkpoint, instead of waiting for ever")


class _KillingOptimStep:
    """The trainer's `optim_step`: SIGKILLs trainer rank 0's proc, then calls the real step."""

    def __init__(self, controller, optim_step):
        self.controller, self.optim_step = controller, optim_step

    def call(self):
        async def kill_then_step():
            procs = self.controller.meshes.watcher.procs
            self.controller.killed_pid = next(p.pid for p in procs if p.name == "trainer rank 0")
            os.kill(self.controller.killed_pid, signal.SIGKILL)
            return await self.optim_step.call()
        return kill_then_step()


class _CountedSend:
    """The trainer's `send_weights`, counting its calls."""

    def __init__(self, send_weights):
        self.send_weights, self.calls = send_weights, 0

    def call(self, version):
        self.calls += 1
        return self.send_weights.call(version)


class TrainerKilledAtTheOptimizerStep(Controller):
    """SIGKILLs trainer rank 0 as step 1's optimizer step goes out, with the push that goes with it."""

    async def start(self) -> None:
        await super().start()
        self.trainer = self.weight_sync.trainer = ActorWith(
            self.trainer, optim_step=_KillingOptimStep(self, self.trainer.optim_step),
            send_weights=_CountedSend(self.trainer.send_weights))


def test_a_trainer_killed_at_an_optimizer_step_that_a_push_went_with_stops_the_run_naming_it(tiny_ckpt, tmp_path):
    config = load_config(None, small_run_overrides(tiny_ckpt, tmp_path, *BROADCAST, "controller.checkpoint_every=0"))
    controller = TrainerKilledAtTheOptimizerStep(config)
    with pytest.raises(TrainingError) as raised:
        asyncio.run(asyncio.wait_for(controller.run(), 120))  # the push in flight must not hold the run
    message = str(raised.value)
    assert controller.trainer.send_weights.calls == 1  # step 1's push went out with its optimizer step
    assert message.startswith(f"step 1: trainer rank 0 (pid {controller.killed_pid}) "), message
    assert message.endswith("continue with --resume"), message
    assert read_metrics(tmp_path) == []


class OnlyReplicaKilledDuringRollouts(Controller):
    """SIGKILLs the only replica as step 2 begins (its rollouts in flight or done); it is
    restarted, and waits for weights that only a broadcast can give it."""

    async def _train_step(self, metrics_log):
        if self.step == 1:
            self.killed_at = await kill_replica(self.router, 0)
        return await super()._train_step(metrics_log)


def test_the_only_replica_of_a_broadcast_run_restarted_mid_step_gets_the_weights_and_the_run_goes_on(
        tiny_ckpt, tmp_path):
    config = load_config(None, small_run_overrides(tiny_ckpt, tmp_path, 'generator.weight_sync="broadcast"',
                                                   "controller.steps=4", "controller.checkpoint_every=0"))
    metrics = asyncio.run(OnlyReplicaKilledDuringRollouts(config).run())
    # The step whose rollouts met no serving replica trains nothing (at most that one); its push
    # then brings the restarted replica up, and the steps after it train again.
    versions = [m["policy/version"] for m in metrics]
    assert versions[-1] >= 3 and versions == sorted(versions) and versions[-1] > versions[-2], versions
    assert metrics[-1]["generator/restarts"] == 1 and metrics[-1]["generator/serving_replicas"] == 1


# -- weights through a shared buffer (generator.weight_sync = "shared": a memfd on CPU, CUDA IPC on GPUs) --

SHARED = ("generator.replicas=2", 'generator.weight_sync="shared"', "controller.checkpoint_every=0")


class _FaultySharedLoads:
    """The router's `load_shared_weights`: push 1 SIGKILLs replica 1 as it starts (a death
    mid-push); push 3 flips one bit of the trainer's buffer, mapped here, after the trainer
    checksummed it. Records the versions each push's replicas loaded, and the router's stats."""

    def __init__(self, controller, endpoint):
        self.controller, self.endpoint, self.after, self.loads = controller, endpoint, None, []

    async def call_one(self, handle, version, checksum, mode=None):
        router = self.controller.router
        if version == 1:
            self.controller.killed_at = await kill_replica(router, 1)
        if version == 3:
            map_buffer(handle).view(torch.int32)[7] ^= 1 << 3
        try:
            loaded = await self.endpoint.call_one(handle, version, checksum, mode)
            self.loads.append((version, [r["version"] for r in loaded["replicas"]]))
            return loaded
        finally:
            self.after = await router.stats.call_one()


class FaultySharedLoads(Controller):
    async def start(self) -> None:
        await super().start()
        self.shared_loads = _FaultySharedLoads(self, self.router.load_shared_weights)
        self.router = self.weight_sync.router = ActorWith(self.router, load_shared_weights=self.shared_loads)

    async def push_weights(self, version):
        if version == 2:  # the restarted replica is up, awaiting the weights of this push
            while (await self.router.awaiting_weights.call_one())["awaiting"] != [1]:
                assert time.monotonic() - self.killed_at < 120, "replica 1 was not restarted"
                await asyncio.sleep(0.1)
        return await super().push_weights(version)


def test_shared_weight_sync_survives_a_death_mid_push_maps_again_on_restart_and_refuses_a_corrupted_buffer(
        tiny_ckpt, tmp_path, fault_record):
    config = load_config(None, small_run_overrides(tiny_ckpt, tmp_path, *SHARED))
    controller = FaultySharedLoads(config)
    with pytest.raises(TrainingError) as raised:
        asyncio.run(asyncio.wait_for(controller.run(), 240))  # a regression hangs: fail instead
    message = str(raised.value)
    # Push 1 reached the survivor; push 2 the restarted replica too (it mapped the buffer again).
    assert controller.shared_loads.loads == [(1, [1]), (2, [2, 2])]
    assert [m["policy/version"] for m in read_metrics(tmp_path)] == [1.0, 2.0]
    assert message.startswith("weight sync of policy version 3 failed: ") and "ChecksumMismatch" in message
    assert "rejected by replica 0" in message and "replica 1" in message and "keeping the previous weights" in message
    stats = controller.shared_loads.after
    assert stats["deaths"] == 1 and stats["restarts"] == 1
    assert [(r["state"], r["version"], r["engine"]["version"]) for r in stats["replicas"]] == \
        [("serving", 2, 2), ("serving", 2, 2)]
    fault_record("shared-buffer weight sync: a replica SIGKILLed mid-push, then a corrupted buffer",
                 "replica 1's proc as step 1's push asks the replicas to load; one bit of the buffer flipped "
                 "after the trainer checksummed step 3's", None,
                 "step 1: the survivor loaded it, the restarted replica mapped the buffer again and loaded step 2's; "
                 f"step 3: both kept version 2 and the run stopped with `{message[:100]}...`")


def test_a_trainer_out_of_gpu_memory_stops_the_run_in_one_line_naming_the_keys(tiny_ckpt, tmp_path, fault_record):
    config = load_config(None, small_run_overrides(tiny_ckpt, tmp_path))
    with pytest.raises(TrainingError) as raised:
        asyncio.run(TrainerOutOfMemoryAtStep(config, oom_step=2).run())
    message = str(raised.value)
    # On CPU the run has no memory plan to quote: the call, torch's first sentences, where it resumes.
    assert message == ("step 2: policy_trainer.forward_backward ran out of GPU memory (CUDA out of memory. Tried to "
                       "allocate 2.66 GiB. GPU 0 has a total capacity of 139.81 GiB of which 1.92 GiB is free); the "
                       f"last complete checkpoint is {checkpoint_dir(tmp_path / 'checkpoints', 1)}; continue with "
                       "--resume")
    assert [m["step"] for m in read_metrics(tmp_path)] == [1]
    fault_record("trainer out of GPU memory", "torch's OutOfMemoryError from the trainer's forward_backward at "
                 "step 2", None, f"step 2 only: the run stopped with `{message.replace(str(tmp_path), '<run_dir>')}`")
