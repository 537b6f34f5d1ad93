"""examples/agent_tools end to end on CPU: the controller starts the gateway, the example's
`openai` agent trains through it (sync and async mode), evaluation runs through it, and in true
on-policy mode the trainer scores exactly what the engine sampled (loss/logprob_diff/max 0)."""

import argparse
import asyncio
import json
from pathlib import Path

import pytest
import torch
from rlactors_examples.agent_tools.env import AgentToolsConfig, CalculatorAgent, calculate

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


def test_a_renumbered_problem_is_worked_by_the_same_steps_on_its_new_numbers():
    import random
    import re

    from rlactors_examples.agent_tools.warm_start import STEP, renumbered

    question = "Jack has 15 buttons. Finn has 5 times as many buttons as Jack. How many buttons do they have together?"
    steps = STEP.findall("Finn has 5 * 15 = 75 buttons. Together they have 15 + 75 = 90 buttons.")
    rng = random.Random(0)
    for _ in range(20):
        new_question, new_steps, answer = renumbered(question, steps, "90", rng)
        jack, finn = map(int, re.findall(r"\d+", new_question))
        assert 7 <= jack <= 30 and 2 <= finn <= 10, new_question
        total = jack + finn * jack
        assert new_steps == [(f"{finn} * {jack}", str(finn * jack)), (f"{jack} + {finn * jack}", str(total))]
        assert answer == str(total)
    # No problem from a draw whose change goes below 0, nor from steps whose result is also a
    # number of the question (which of the two a later step means is unknown).
    change = STEP.findall("3 of them cost 3 * 14 = $42. The change is 50 - 42 = $8.")
    draws = [renumbered("A ticket costs $14. Nina buys 3 of them and pays with a $50 bill.", change, "8", rng)
             for _ in range(200)]
    assert None in draws and all(int(d[2]) >= 0 for d in draws if d)
    assert renumbered("Ann has 4 apples and 2 pears. She eats 2 * 2 of them.", [("2 * 2", "4")], "4", rng) is None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_the_gpu_warm_starts_gathered_batch_trains_as_the_packed_rows(tmp_path, device):
    """The GPU path of the warm start (one flat microbatch gathered on the device) gives the loss and
    gradients of the CPU path (the trainer's rows, here two with padding), both run on `device`."""
    import random

    from rlactors_examples.alphabet_sort.warm_start import gathered, packed_rows, sft_episode

    from rlactors.models import from_pretrained
    from rlactors.models.tiny import make_tiny_checkpoint

    make_tiny_checkpoint(tmp_path, seed=0)
    model = from_pretrained(tmp_path, dtype=torch.float32, device=device)
    rng = random.Random(0)
    episodes = [sft_episode([rng.randrange(256) for _ in range(n)], [rng.random() < 0.5 for _ in range(n)])
                for n in (600, 40, 500, 90, 300)]
    picked = [2, 0, 4, 1, 3, 1]

    def loss_and_grads(batches):
        microbatches = batches(picked)
        tokens = sum(int(mask.sum()) for *_, mask in microbatches)
        loss = sum(-(model.token_logprobs(model.forward_packed(ids.to(device), pos.to(device), backend="sdpa"),
                                          targets.to(device)) * mask.to(device)).sum()
                   for ids, pos, targets, mask in microbatches) / tokens
        return loss, tokens, torch.autograd.grad(loss, list(model.parameters())), microbatches

    rows, flat = loss_and_grads(packed_rows(episodes)), loss_and_grads(gathered(episodes, torch.device(device)))
    assert rows[3][0][0].numel() > flat[3][0][0].numel() == sum(len(episodes[i]) - 1 for i in picked)  # padding
    assert rows[1] == flat[1] == sum(sum(episodes[i].loss_mask[1:]) for i in picked)
    tolerance = {} if device == "cpu" else {"rtol": 1e-4, "atol": 1e-5}  # CUDA: other kernels per shape, atomics
    torch.testing.assert_close(flat[0], rows[0], **tolerance)
    for a, b in zip(flat[2], rows[2]):
        torch.testing.assert_close(a, b, **tolerance)


def test_the_accuracy_stop_checks_every_n_steps_and_stops_at_the_first_check_at_the_threshold():
    from rlactors_examples.agent_tools.warm_start import stop_at

    checked = []
    accuracies = iter([0.1, 0.29, 0.3, 0.9])
    stop = stop_at(0.3, 5, lambda step: checked.append(step) or next(accuracies))
    assert next(step for step in range(1, 30) if stop(step)) == 15
    assert checked == [5, 10, 15]


def test_the_warm_start_stops_at_its_first_check_at_the_threshold_with_that_steps_checkpoint(tmp_path, monkeypatch,
                                                                                            capsys):
    """The checks score greedy agent episodes on the last train problems, which the demonstrations
    leave out; the warm start stops at the first check at the threshold and writes that step's
    weights, the same as a run of that many steps whose checks do not stop it."""
    from rlactors_examples.agent_tools import warm_start

    from rlactors.models import load_tokenizer

    scored = []
    real = warm_start.agent_accuracy
    monkeypatch.setattr(warm_start, "agent_accuracy",
                        lambda model, tokenizer, config, problems: scored.append(problems) or
                        real(model, tokenizer, config, problems))
    common = ["--batch-size", "2", "--check-every", "3", "--check-problems", "4",
              "--config", str(ROOT / "configs/agent_tools_cpu.toml")]
    monkeypatch.chdir(ROOT)
    warm_start.main([str(tmp_path / "stopped"), "--steps", "9", "--until-accuracy", "0", *common])
    out = capsys.readouterr().out
    assert "check at step 3: accuracy 0.000 on 4 held-out train problems" in out and "(3 steps)" in out, out
    warm_start.main([str(tmp_path / "full"), "--steps", "3", "--until-accuracy", "1", *common])
    out = capsys.readouterr().out
    assert "check at step 3: accuracy 0.000" in out and "(3 steps)" in out, out
    assert (tmp_path / "stopped/model.safetensors").read_bytes() == (tmp_path / "full/model.safetensors").read_bytes()

    tokenizer = load_tokenizer(tmp_path / "full")
    train = CalculatorAgent(AgentToolsConfig(), tokenizer)
    assert scored == [train.dataset("train")[-4:]] * 2
    assert not {p["question"] for p in scored[0]} & {p["question"] for p in train.dataset("eval")}
    args = argparse.Namespace(until_accuracy=0.5, check_problems=4, variants=0, seed=0)
    demonstrated = [tokenizer.decode(e.token_ids) for e in warm_start.demonstrations(tokenizer, args)]
    assert not any(p["question"] in text for p in scored[0] for text in demonstrated)
    every_problem = warm_start.demonstrations(tokenizer, argparse.Namespace(**{**vars(args), "until_accuracy": None}))
    assert scored[0][0]["question"] in tokenizer.decode(every_problem[-4].token_ids)


def test_the_warm_start_refuses_a_bad_accuracy_a_held_out_slice_without_demonstrations_or_a_bad_config(tmp_path,
                                                                                                       capsys):
    from rlactors_examples.agent_tools.warm_start import main, stop_at_accuracy

    with pytest.raises(SystemExit):
        main([str(tmp_path), "--until-accuracy", "1.5"])
    assert "--until-accuracy: must be between 0 and 1, got 1.5" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--check-problems 500: the train split has only 500 problems"):
        main([str(tmp_path / "out"), "--until-accuracy", "0.5", "--check-problems", "500"])
    assert not (tmp_path / "out").exists()
    bad = tmp_path / "bad.toml"
    bad.write_text('[rollout]\nmax_turns = "three"\n')
    for config, message in [(bad, "rollout.max_turns"), (tmp_path / "none.toml", "config file not found")]:
        args = argparse.Namespace(until_accuracy=0.5, config=config, check_problems=4, check_every=1)
        with pytest.raises(SystemExit, match=f"--config {config}: .*{message}"):
            stop_at_accuracy(None, None, args)


def test_a_checks_accuracy_does_not_depend_on_which_episodes_share_the_engine():
    """Four train problems played together score as each played alone: the committed CPU warm start
    answers exactly one of them right (the one-step problem), whatever else the engine batches."""
    from rlactors_examples.agent_tools.warm_start import Episodes, agent_accuracy, held_out_problems

    from rlactors.models import from_pretrained, load_tokenizer

    checkpoint = ROOT / "examples/agent_tools/warm_checkpoint"
    config = Episodes.of(ROOT / "configs/agent_tools_cpu.toml")
    tokenizer = load_tokenizer(checkpoint)
    model = from_pretrained(checkpoint, dtype=torch.float32)
    problems = held_out_problems(tokenizer, 17)[:4]
    alone = [agent_accuracy(model, tokenizer, config, [p])["eval/reward/correct_mean"] for p in problems]
    assert alone == [1.0, 0.0, 0.0, 0.0], (alone, problems)
    together = agent_accuracy(model, tokenizer, config, problems)
    assert together["eval/reward/correct_mean"] == 0.25 and together["eval/status/completed"] == 4
