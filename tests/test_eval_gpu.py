"""Evaluation on the GPU path (device machines): an async run with the trainer and a vLLM replica
colocated on one GPU evaluates on schedule, and the evaluate command scores its run dir with
vLLM. Skipped without CUDA and vLLM."""

from __future__ import annotations

import asyncio
import json

from support.vllm_checks import NEEDS_VLLM_GPU

from rlactors.config import load_config
from rlactors.evaluate import main as evaluate_main
from rlactors.models.tiny import make_tiny_checkpoint
from rlactors.run.controller import Controller
from rlactors.run.metrics import EVAL_REWARD_MEAN, read_metrics

pytestmark = NEEDS_VLLM_GPU


def test_async_colocated_vllm_run_evaluates_on_schedule_and_the_command_scores_its_run_dir(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", size="small", seed=0, dtype="bfloat16")
    run_dir = tmp_path / "run"
    config = load_config(None, [
        f'model.path="{ckpt}"', 'model.dtype="bfloat16"', f'controller.run_dir="{run_dir}"', 'controller.device="cuda"',
        "controller.colocate=true", 'generator.engine="vllm"', "generator.replicas=1",
        "generator.gpu_memory_utilization=0.3", "generator.max_model_len=512", "trainer.ranks=1", "trainer.lr=1e-3",
        "controller.steps=3", "controller.mode=async", "controller.max_staleness=1", "controller.eval_every=2",
        "eval.samples=16", "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_turns=2",
        "rollout.max_tokens_per_turn=48", "rollout.max_total_tokens=512", "rollout.keep_zero_variance_groups=true",
        "batcher.row_tokens=2048", "env.args={ max_turns = 2, max_names_per_turn = 2 }"])
    history = asyncio.run(Controller(config).run())
    assert [m["policy/version"] for m in history] == [1.0, 2.0, 3.0]
    evals = [r for r in read_metrics(run_dir) if EVAL_REWARD_MEAN in r]
    assert [r["step"] for r in evals] == [0, 2, 3]
    assert [r["eval/policy_version"] for r in evals] == [0, 2, 3]
    for record in evals:
        assert record["eval/rollouts"] == 16 and record["eval/status/error_generator"] == 0
        assert record["eval/policy_version_max"] >= record["eval/policy_version"]

    out = tmp_path / "eval.json"
    assert evaluate_main([str(run_dir), "--no-progress", "--out", str(out)]) == 0
    scored = json.loads(out.read_text())
    assert (scored["step"], scored["eval/policy_version"], scored["eval/rollouts"]) == (3, 3, 16)
    assert 0.0 <= scored[EVAL_REWARD_MEAN] <= 1.0 and scored["eval/status/error_generator"] == 0
