"""examples/agent_tools end to end on CPU: the controller starts the gateway, the example's
`openai` agent trains through it (sync and async mode), evaluation runs through it, and in true
on-policy mode the trainer scores exactly what the engine sampled (loss/logprob_diff/max 0)."""

import asyncio
import json
from pathlib import Path

import pytest
from rlactors_examples.agent_tools.env import calculate

from rlactors.config import load_config
from rlactors.evaluate import main as evaluate_main
from rlactors.run.controller import Controller
from rlactors.run.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_agent_trains_through_the_gateway_true_on_policy(tmp_path, mode):
    config = load_config(ROOT / "configs" / "agent_tools_cpu.toml", [f"controller.mode={mode}",
        "controller.max_staleness=1",
        f'model.path="{ROOT / "examples/agent_tools/warm_checkpoint"}"', f'controller.run_dir="{tmp_path}"',
        "model.true_on_policy=true", "controller.steps=2", "controller.eval_every=2", "eval.samples=2",
        "trainer.ranks=1", "generator.replicas=1", "rollout.prompts_per_step=2",
        "rollout.keep_zero_variance_groups=true"])
    history = asyncio.run(Controller(config).run())
    assert [m["policy/version"] for m in history] == [1.0, 2.0]
    for m in history:
        assert m["loss/logprob_diff/max"] == 0.0 and m["loss/tokens"] > 0, m
        assert m["rollout/rollouts"] == 8 and not any(v for k, v in m.items() if k.startswith("rollout/status/error"))
        assert m["gateway/client_errors"] == 0
    # Every turn was a request to the gateway, counted in the step it ran in (in async mode, some of
    # a step's rollouts run during the step before); evaluation's turns too.
    assert sum(m["gateway/requests"] for m in history) >= sum(m["rollout/turns_mean"] * 8 for m in history)
    assert sum(m["gateway/tool_calls"] for m in history) > 0  # the warm policy calls the calculator
    evals = [r for r in read_metrics(tmp_path) if "eval/reward_mean" in r]
    assert [r["step"] for r in evals] == [0, 2], evals
    assert all(r["eval/rollouts"] == 2 for r in evals), evals


def test_the_evaluate_command_scores_the_agent_through_a_gateway_of_its_own(tmp_path):
    out = tmp_path / "eval.json"
    assert evaluate_main([str(ROOT / "examples/agent_tools/warm_checkpoint"), "--config",
                          str(ROOT / "configs/agent_tools_cpu.toml"), "eval.samples=4", "generator.replicas=1",
                          "--no-progress", "--out", str(out)]) == 0
    metrics = json.loads(out.read_text())
    assert metrics["eval/rollouts"] == 4 and metrics["eval/status/error_env"] == 0
    assert metrics["eval/turns_mean"] >= 1 and metrics["eval/reward/tool_call_mean"] > 0


def test_calculator_tool():
    assert calculate("17 * 23") == "391" and calculate("(2 + 4) / 4") == "1.5" and calculate("-3") == "-3"
    assert calculate("1 / 0") == "error: division by zero"
    assert calculate("__import__('os')").startswith("error:") and calculate("2 **").startswith("error:")
