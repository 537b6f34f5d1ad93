"""Evaluation in the training loop and the evaluate command, with real Monarch procs on CPU (one
trainer rank, one native replica, SplitEnv: one short turn on random prompts).

The runs use model.true_on_policy, where the native engine's logits do not depend on the batch: a
greedy eval of the same weights gives the same tokens whatever else the replica is generating, so
evals and training runs can be compared exactly across runs."""

import asyncio
import importlib.util
import json

import pytest
from support.eval_envs import SplitEnv
from support.metric_sinks import tensorboard_scalars, wandb_history

from rlactors.config import ConfigError, load_config
from rlactors.evaluate import main as evaluate_main
from rlactors.run.controller import Controller
from rlactors.run.metrics import EVAL_REWARD_MEAN, REWARD_MEAN, read_metrics


def _config(ckpt, run_dir, *extra):
    return load_config(None, [
        f'model.path="{ckpt}"', f'controller.run_dir="{run_dir}"', "controller.log_samples=false",
        "model.true_on_policy=true", "trainer.ranks=1", "trainer.lr=1e-3", "generator.replicas=1",
        "generator.max_model_len=256", "generator.kv_cache_tokens=4096", "rollout.prompts_per_step=2",
        "rollout.group_size=2", "rollout.max_turns=1", "rollout.max_tokens_per_turn=8",
        "rollout.max_total_tokens=256", "rollout.keep_zero_variance_groups=true", "batcher.row_tokens=256",
        'env.name="support.eval_envs:SplitEnv"', "eval.samples=4", *extra])


def _run(config, resume=False):
    return asyncio.run(asyncio.wait_for(Controller(config, resume=resume).run(), 300))  # a hang fails instead


def _evals(run_dir):
    return [r for r in read_metrics(run_dir) if EVAL_REWARD_MEAN in r]


def _eval_requests(step):
    return [s for s in SplitEnv.seen if s.request_id.startswith(f"eval{step}-")]


def test_sync_evals_at_step_0_every_n_steps_and_the_end_each_on_its_steps_policy(tiny_ckpt, tmp_path, capsys,
                                                                                 monkeypatch):
    wandb = importlib.util.find_spec("wandb") is not None  # the `dev` extra installs it
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    SplitEnv.seen.clear()
    run_dir = tmp_path / "sync"
    history = _run(_config(tiny_ckpt, run_dir, "controller.steps=3", "controller.eval_every=2",
                           *(['metrics.wandb_project="rlactors-test"'] if wandb else [])))
    assert [m["policy/version"] for m in history] == [1.0, 2.0, 3.0]
    evals = _evals(run_dir)
    assert [r["step"] for r in evals] == [0, 2, 3]
    # Each eval ran on its step's policy alone: sync mode holds the next update until it is done.
    assert [(r["eval/policy_version"], r["eval/policy_version_max"]) for r in evals] == [(0, 0), (2, 2), (3, 3)]
    for step, record in zip((0, 2, 3), evals):
        requests = _eval_requests(step)
        assert sorted((s.split, s.sample_id) for s in requests) == [("eval", i) for i in range(4)]
        assert {v for s in requests for v in s.versions} == {step}
        assert record["eval/rollouts"] == 4
        assert record["eval/generated_tokens"] == sum(len(s.token_ids) for s in requests)
    # Training saw only train samples, under its own ids.
    training = [s for s in SplitEnv.seen if not s.request_id.startswith("eval")]
    assert len(training) == 3 * 2 * 2 and all(s.split == "train" and s.request_id.startswith("g") for s in training)

    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out if line.startswith("eval of step")] == [
        "eval of step 0", "eval of step 2", "eval of step 3"]
    assert (run_dir / "reward_curve.png").is_file()
    tensorboard = tensorboard_scalars(run_dir)
    assert [(step, round(v, 6)) for step, v in tensorboard[EVAL_REWARD_MEAN]] == [
        (r["step"], round(r[EVAL_REWARD_MEAN], 6)) for r in evals]
    if wandb:
        rows = wandb_history(run_dir)
        assert rows == [{k: v for k, v in r.items() if k != "time"} for r in read_metrics(run_dir)]


def test_async_training_goes_on_while_an_eval_runs(tiny_ckpt, tmp_path):
    """Scoring each eval sample takes 4 s here: training steps complete meanwhile, and the run
    waits for the last step's eval before it ends."""
    run_dir = tmp_path / "async"
    history = _run(_config(tiny_ckpt, run_dir, "controller.steps=4", "controller.eval_every=4",
                           "controller.mode=async", "controller.max_staleness=1", "env.args={ eval_step_s = 4.0 }"))
    assert [m["policy/version"] for m in history] == [1.0, 2.0, 3.0, 4.0]
    records = read_metrics(run_dir)
    evals = _evals(run_dir)
    assert [r["step"] for r in evals] == [0, 4] and evals[0]["eval/policy_version"] == 0
    assert evals[1]["eval/policy_version"] == 4
    started, ended = evals[0]["time"] - evals[0]["eval/time_s"], evals[0]["time"]
    assert ended - started >= 4.0
    during = [r["step"] for r in records if REWARD_MEAN in r and started < r["time"] < ended]
    assert during, (f"no step completed during the step-0 eval ({started:.2f}-{ended:.2f}): "
                    f"{[(r['step'], round(r['time'], 2)) for r in records]}")


def test_a_resumed_run_keeps_the_eval_schedule_and_the_evaluate_command_agrees_with_it(tiny_ckpt, tmp_path,
                                                                                       capsys):
    run_dir = tmp_path / "resumed"
    first = _run(_config(tiny_ckpt, run_dir, "controller.steps=2", "controller.eval_every=3"))
    assert [r["step"] for r in _evals(run_dir)] == [0, 2]  # step 0, and the end
    second = _run(_config(tiny_ckpt, run_dir, "controller.steps=4", "controller.eval_every=3"), resume=True)
    assert len(first) == 2 and len(second) == 2
    # Not step 0 or 2 again: the next evals are the ones due after the checkpoint, at 3 and the end.
    evals = _evals(run_dir)
    assert [r["step"] for r in evals] == [0, 2, 3, 4]
    assert [r["eval/policy_version"] for r in evals] == [0, 2, 3, 4]

    # The same training, whatever the eval schedule (another run evaluated at steps 0, 1 and 2).
    other = _run(_config(tiny_ckpt, tmp_path / "other", "controller.steps=2", "controller.eval_every=1"))
    for key in ("loss/loss", REWARD_MEAN, "train/grad_norm"):
        assert [m[key] for m in other] == [m[key] for m in first], key
    other_evals = _evals(tmp_path / "other")
    assert [(r["step"], r[EVAL_REWARD_MEAN]) for r in other_evals if r["step"] in (0, 2)] == [
        (r["step"], r[EVAL_REWARD_MEAN]) for r in evals[:2]]

    # The evaluate command on the run dir scores its newest checkpoint (step 4) as the run did.
    out = tmp_path / "eval.json"
    assert evaluate_main([str(run_dir), "--no-progress", "--out", str(out)]) == 0
    scored = json.loads(out.read_text())
    assert scored["checkpoint"] == str(run_dir / "checkpoints" / "step_00000004" / "hf") and scored["step"] == 4
    for key in (EVAL_REWARD_MEAN, "eval/generated_tokens", "eval/samples", "eval/policy_version",
                "eval/policy_version_max"):
        assert scored[key] == evals[3][key], key
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith(
        f"{run_dir / 'checkpoints' / 'step_00000004' / 'hf'}: eval of step 4: reward {evals[3][EVAL_REWARD_MEAN]:.3f}")
    assert ", policy version 4, " in line  # the replicas' weights are the checkpoint's policy, not a version 0


def test_an_env_without_an_eval_split_stops_the_run_at_start(tiny_ckpt, tmp_path):
    (tmp_path / "train.jsonl").write_text('{"question": "1+1?", "answer": "2"}\n')
    config = _config(tiny_ckpt, tmp_path / "run", "controller.eval_every=5", 'env.name="rlactors.envs:DatasetEnv"',
                     f'env.args={{ train_path = "{tmp_path / "train.jsonl"}" }}')
    with pytest.raises(ConfigError) as error:
        asyncio.run(Controller(config).run())
    assert str(error.value) == ("controller.eval_every=5: env rlactors.envs:DatasetEnv has no eval split: "
                                "dataset('eval') raised ConfigError: env.args.eval_path: no eval split: "
                                "set eval_path or eval_fraction")
    assert not (tmp_path / "run").exists()  # stopped before anything was spawned or written
