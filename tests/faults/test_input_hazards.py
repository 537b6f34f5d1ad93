"""Inputs that a run survives but must not pass over in silence, through the real controller with
real Monarch procs on CPU: records whose prompt alone fills rollout.max_total_tokens, an env that
blocks the event loop (named by the watchdog; Ctrl-C still ends the run), and a checkpoint save
that fails on one trainer rank (one line, no hang)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import time

import hazard_envs
import pytest
from faultkit import CliProcess, child_pids, small_run_overrides, wait_until
from support.linux import running

from rlactors.config import load_config
from rlactors.models.checkpoint import TOKENIZER_FILES
from rlactors.run.controller import Controller, TrainingError
from rlactors.run.metrics import read_metrics
from rlactors.trainer.checkpoint import checkpoint_dir

PROC_EXITED = re.compile(r"^.+ \(pid \d+\) exited ")  # a lost proc's verdict (rlactors.procs.liveness)


def test_records_whose_prompt_leaves_no_room_are_named_at_load_counted_per_step_and_kept_in_samples(
        tiny_ckpt, tmp_path, capsys, fault_record):
    data = tmp_path / "train.jsonl"
    long_question = " ".join(["count the sheep in the field"] * 20) + "?"
    data.write_text("".join(json.dumps(r) + "\n" for r in (
        {"question": "1 + 1?", "answer": "2"}, {"question": long_question, "answer": "3"},
        {"question": "2 + 2?", "answer": "4"})))
    run_dir = tmp_path / "run"
    config = load_config(None, small_run_overrides(
        tiny_ckpt, run_dir, "controller.steps=2", "controller.checkpoint_every=0", "controller.log_samples=true",
        "rollout.max_total_tokens=64", 'env.name="rlactors.envs:DatasetEnv"',
        f'env.args={{ train_path = "{data}" }}'))
    history = asyncio.run(asyncio.wait_for(Controller(config).run(), 300))
    out = capsys.readouterr().out
    warning = [line for line in out.splitlines() if line.startswith("warning: ")]
    assert len(warning) == 1 and warning[0].startswith(
        "warning: 1 of 3 train samples have a prompt of at least rollout.max_total_tokens=64 tokens, which leaves no "
        "room to generate: train.jsonl:2 (")
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    long_ones = [s for s in samples if s["status"] == "truncated_context"]
    # 4 groups over 2 steps from 3 records: the first epoch holds the long record once, the second may.
    per_step = [len({s["group"] for s in long_ones if s["step"] == step}) for step in (1, 2)]
    assert sum(per_step) >= 1
    assert [m["rollout/prompts_too_long"] for m in history] == per_step
    assert [r["rollout/prompts_too_long"] for r in read_metrics(run_dir)] == per_step
    assert all(len(s["turns"]) == 1 and long_question in s["turns"][0]["prompt"]
                             and s["turns"][0]["completion"] == "" for s in long_ones)
    fault_record("bad inputs", "a dataset record whose prompt alone fills rollout.max_total_tokens", None,
                 "nothing: the record is named at load (FILE:ROW, prompt tokens), counted per step "
                 "(rollout/prompts_too_long), its rollouts end truncated_context with the prompt in samples.jsonl")


def _descendants(pid: int) -> list[int]:
    children = child_pids(pid)
    return children + [d for child in children for d in _descendants(child)]


def test_an_env_that_blocks_the_loop_is_named_and_ctrl_c_twice_ends_the_run(tiny_ckpt, tmp_path, fault_record):
    """BlockingEnv's step sleeps 600 s in the loop's thread from step 2 on: the step timeout cannot
    fire and the first Ctrl-C's cancellation cannot run, so the second must quit at once."""
    run_dir = tmp_path / "run"
    cli = CliProcess(*small_run_overrides(tiny_ckpt, run_dir, 'env.name="hazard_envs:BlockingEnv"',
                                          "env.args={ block_s = 600.0, block_from_group = 2 }",
                                          "rollout.step_timeout_s=2.0", "controller.steps=5"), new_session=True)
    try:
        # On a busy machine the watchdog may first name another slow call on the loop (a weight
        # sync's pickling): wait for the line that names the env.
        named = f"s in BlockingEnv.step ({hazard_envs.__file__}:"
        warned = wait_until(lambda: cli.first_line_after("stderr", 0, named)
                            or cli.proc.poll() is not None, 180, what="the watchdog's line")
        stderr = cli.text("stderr")
        assert cli.proc.poll() is None, stderr[-3000:]
        warning = next(line for line in stderr.splitlines() if named in line)
        assert "event loop has been blocked" in warning
        assert ": time.sleep(self.config.block_s)): " in warning
        procs = _descendants(cli.proc.pid)
        assert procs  # the trainer, router and replica procs

        cli.interrupt()
        wait_until(lambda: cli.first_line_after("stderr", warned, "interrupted: the event loop is blocked in"), 30,
                   what="the first Ctrl-C's line")
        assert cli.proc.poll() is None  # blocked: the run cannot stop by itself
        interrupted_at = time.monotonic()
        cli.interrupt()
        code = cli.wait(60)
        quit_s = time.monotonic() - interrupted_at
    finally:
        if cli.proc.poll() is None:
            os.killpg(cli.proc.pid, 9)
            cli.wait(30)
    stderr = cli.text("stderr").splitlines()
    assert code == 130 and not any("Traceback" in line for line in stderr), stderr[-30:]
    # Ctrl-C reaches the actor procs too: on a busy machine the verdict on one that has exited may
    # be printed between the two Ctrl-C's lines, or after them; nothing else may.
    said = [line for line in stderr if not PROC_EXITED.match(line)]
    assert said[-2].startswith("interrupted: the event loop is blocked in BlockingEnv.step (")
    assert said[-2].endswith("; the run stops once that call returns (Ctrl-C again to quit at once)")
    saved = checkpoint_dir(run_dir / "checkpoints", 1)
    assert said[-1] == f"interrupted again: quitting at once; the last complete checkpoint is {saved}; continue " \
                       "with --resume"
    wait_until(lambda: not any(running(pid) for pid in procs), 30, what="the actor procs' exit")
    fault_record("env blocks the loop", "time.sleep(600) in an env's step from step 2 on "
                 "(rollout.step_timeout_s=2), then Ctrl-C twice", None,
                 f"the rollouts of step 2: the watchdog named BlockingEnv.step and its line after 2 s, the first "
                 f"Ctrl-C said where the loop is blocked, the second quit in {quit_s:.1f} s naming step 1's "
                 "checkpoint; no actor proc left")


def test_a_checkpoint_save_that_fails_stops_the_run_with_one_line_instead_of_hanging(tiny_ckpt, tmp_path,
                                                                                     fault_record):
    """model.path loses its tokenizer files after the start (the check before the start would
    refuse the dir): the step-1 save fails on trainer rank 0, and before the fix rank 1 waited at
    a barrier for ever, and the run with it."""
    model = tmp_path / "model"
    shutil.copytree(tiny_ckpt, model)
    config = load_config(None, small_run_overrides(model, tmp_path / "run", "trainer.ranks=2"))
    controller = Controller(config)

    async def run():
        try:
            await controller.start()
            for name in TOKENIZER_FILES:
                (model / name).unlink(missing_ok=True)
            return await controller.train()
        finally:
            await controller.shutdown()

    started = time.monotonic()
    with pytest.raises(TrainingError) as error:
        asyncio.run(asyncio.wait_for(run(), 300))
    stopped_s = time.monotonic() - started
    assert str(error.value) == ("saving the checkpoint of step 1 failed: ValueError: "
                                f"{model} holds no tokenizer files; no checkpoint was completed")
    assert list((tmp_path / "run" / "checkpoints").iterdir()) == []  # no .step_00000001.partial
    fault_record("checkpoint save fails", "model.path's tokenizer files removed after the start, 2 trainer ranks "
                 "(the save's HF export on rank 0 fails)", None,
                 f"the run stops in {stopped_s:.0f} s with one line `saving the checkpoint of step 1 failed: "
                 "ValueError: ... holds no tokenizer files; ...` and no partial dir (it hung before)")
