"""Inputs that a run survives but must not pass over in silence, through the real controller with
real Monarch procs on CPU: records whose prompt alone fills rollout.max_total_tokens."""

from __future__ import annotations

import asyncio
import json

from faultkit import small_run_overrides

from rlactors.config import load_config
from rlactors.controller import Controller
from rlactors.metrics import read_metrics


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
