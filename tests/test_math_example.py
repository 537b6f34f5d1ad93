"""examples/math: the generated word problems and the CPU config, trained end to end on real Monarch procs."""

import asyncio
import json
import math
import re
import shutil
from pathlib import Path

import pytest
from rlactors_examples.math.generate import make_problems, write_splits

from rlactors.config import EnvConfig, load_config
from rlactors.models.tokenizer import load_tokenizer
from rlactors.rollout import load_env
from rlactors.rollout.rewards import reference_answer
from rlactors.run.controller import Controller
from rlactors.run.metrics import read_metrics
from rlactors.trainer.checkpoint import checkpoint_dir

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples" / "math" / "data"


def test_the_committed_data_is_what_the_script_writes(tmp_path):
    train, eval_ = write_splits(tmp_path, 500, 100, seed=0)
    assert train.read_bytes() == (DATA / "train.jsonl").read_bytes()
    assert eval_.read_bytes() == (DATA / "eval.jsonl").read_bytes()


def test_problems_are_distinct_and_their_answers_are_right():
    problems = make_problems(300, seed=3)
    assert problems == make_problems(300, seed=3) and problems != make_problems(300, seed=4)
    assert len({p["question"] for p in problems}) == 300
    for p in problems:
        answer = int(reference_answer(p["answer"]))
        work = p["answer"].split("\n#### ")[0]
        # Every step "a op b = c" of the worked solution is right, and the last result is the answer.
        steps = re.findall(r"(\d+) ([-+*/]) (\d+) = \$?(\d+)", work)
        assert steps, p
        for a, op, b, result in steps:
            assert eval(f"{a} {op} {b}") == int(result), p  # noqa: S307 - digits and one operator
        assert int(steps[-1][3]) == answer >= 0, p


def test_the_configs_load_and_read_the_data():
    cpu = load_config(ROOT / "configs" / "math_cpu.toml")
    gpu = load_config(ROOT / "configs" / "math_1gpu.toml", available_gpus=1)
    assert cpu.env.name == gpu.env.name == "rlactors.envs:DatasetEnv"
    assert cpu.rollout.overlong_buffer_tokens > 0 and cpu.rollout.mask_truncated
    tok = load_tokenizer(ROOT / cpu.model.path)
    args = {**cpu.env.args, **{k: str(ROOT / v) for k, v in cpu.env.args.items() if k.endswith("_path")}}
    env = load_env(EnvConfig(name=cpu.env.name, args=args), tok)
    train, eval_ = env.dataset("train"), env.dataset("eval")
    assert len(train) == 500 and len(eval_) == 100
    assert not {s["prompt"] for s in train} & {s["prompt"] for s in eval_}
    assert all(s["answer"].isdigit() for s in train + eval_)


def _math_cpu(run_dir, *extra):
    return load_config(ROOT / "configs" / "math_cpu.toml", [
        f'controller.run_dir="{run_dir}"', f'model.path="{ROOT / "examples/alphabet_sort/warm_checkpoint"}"',
        f'env.args.train_path="{DATA / "train.jsonl"}"', f'env.args.eval_path="{DATA / "eval.jsonl"}"', *extra])


def test_math_cpu_config_trains_and_resumes_exactly(tmp_path):
    """The CPU config as shipped (fewer steps): rewards computed from the data, the policy trained;
    a run stopped after step 1 and resumed gives step 2 exactly as an uninterrupted run."""
    straight_dir = tmp_path / "straight"
    config = _math_cpu(straight_dir, "controller.steps=2", "controller.checkpoint_every=1")
    straight = asyncio.run(Controller(config).run())
    assert [m["policy/version"] for m in straight] == [1.0, 2.0]
    for m in straight:
        assert m["rollout/rollouts"] == 32
        assert {"rollout/reward/correct_mean", "rollout/reward/format_mean", "rollout/reward/overlong_mean"} <= set(m)
        assert m["rollout/reward_std"] > 0 and math.isfinite(m["loss/loss"]) and m["loss/tokens"] > 0
    samples = [json.loads(line) for line in (tmp_path / "straight" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 8 * 2

    # The straight run as a run stopped after step 1 leaves it: step 2's checkpoint not written
    # (--resume drops step 2's records).
    interrupted = tmp_path / "interrupted"
    shutil.copytree(straight_dir, interrupted)
    shutil.rmtree(checkpoint_dir(interrupted / "checkpoints", 2))
    resumed = asyncio.run(Controller(_math_cpu(interrupted, "controller.steps=2"), resume=True).run())
    assert len(resumed) == 1
    for key in ("loss/loss", "rollout/reward_mean", "loss/tokens", "train/grad_norm"):
        assert resumed[0][key] == pytest.approx(straight[1][key], rel=1e-5, abs=1e-7), key
    assert [r["step"] for r in read_metrics(interrupted)] == [1, 2]
