"""examples/code_tests with scripted replies through the Rollouter: the reward is the share of tests
the last attempt passed, a failed attempt gets its first failure back, and a program that
misbehaves (loops, spoofs the result line, exits early) scores what it earned, never an env error."""

from __future__ import annotations

import asyncio

import pytest
from rlactors_examples.code_tests.env import CodeTestsConfig, CodeTestsEnv, extract_code

from rlactors.config import ConfigError, RolloutConfig
from rlactors.envs.sandbox import SandboxUnavailable
from rlactors.models import load_tokenizer
from rlactors.rollout import Rollouter, RolloutStatus
from rlactors.types import Completion

LINEAR = {"name": "f", "prompt": "Write a Python function `f(x)` that returns 3 * x + 1. For example, f(0) == 1.",
          "cases": [[[1], 4], [[2], 7], [[5], 16], [[-1], -2]], "solution": "def f(x):\n    return 3 * x + 1\n"}


def fenced(code: str) -> str:
    return f"Here it is:\n```python\n{code}```"


def play(tiny_ckpt, replies: list[str], config: CodeTestsConfig = CodeTestsConfig(wall_s=2.0)):
    """One rollout of LINEAR (group of 2, the same replies) whose turns answer `replies` in turn,
    and the prompts of its turns."""
    tokenizer = load_tokenizer(tiny_ckpt)
    try:
        env = CodeTestsEnv(config, tokenizer)
    except SandboxUnavailable as e:
        pytest.skip(f"no sandbox on this machine: {e}")
    prompts = {}  # request id: the prompt's text

    async def generate(prompt_token_ids, sampling, request_id, session_id=None, on_tokens=None):
        prompts[request_id] = tokenizer.decode(prompt_token_ids)
        turn = int(request_id.rsplit("/t", 1)[1])
        ids = tokenizer.encode(replies[turn], add_special_tokens=False) + [tokenizer.eos_token_id]
        return Completion(request_id, list(prompt_token_ids), ids, [-1.0] * len(ids), [0] * len(ids), "stop")

    rollout = RolloutConfig(group_size=2, max_turns=3, max_tokens_per_turn=256, max_total_tokens=2048,
                            keep_zero_variance_groups=True)
    batch = asyncio.run(Rollouter(env, generate, rollout).collect([LINEAR]))
    rollout = batch.groups[0].rollouts[0]
    return rollout, [prompts[f"g0/0/t{k}"] for k in range(len(rollout.turns))]


def test_a_right_answer_scores_1_in_one_attempt(tiny_ckpt):
    rollout, prompts = play(tiny_ckpt, [fenced(LINEAR["solution"])])
    assert rollout.status is RolloutStatus.COMPLETED and rollout.reward_components == {"tests": 1.0}
    assert len(rollout.turns) == 1 and rollout.turns[0].info == {"passed": 4, "outcome": "ok"}
    assert "returns 3 * x + 1" in prompts[0]


def test_a_failed_attempt_is_told_its_first_failure_and_the_retry_scores(tiny_ckpt):
    wrong = "def f(x):\n    return 3 * x if x > 1 else 3 * x + 1\n"  # passes f(1) and f(-1) only
    rollout, prompts = play(tiny_ckpt, [fenced(wrong), fenced(LINEAR["solution"])])
    assert rollout.reward_components == {"tests": 1.0} and len(rollout.turns) == 2
    assert "2 of 4 tests passed. f(2) returned 6, expected 7\nFix the function." in prompts[1]
    rollout, _ = play(tiny_ckpt, [fenced(wrong), fenced(wrong)])
    assert rollout.reward_components == {"tests": 0.5} and rollout.status is RolloutStatus.COMPLETED


@pytest.mark.parametrize("code, told", [
    ("while True:\n    pass\n", "the program did not finish its tests: timeout"),
    ("import sys\nprint(sys.stdin.read())\nprint('x 4 4 \"\"')\n", "f(1) returned None"),  # no f; spoofs fail
    ("import os\nos._exit(0)\n", "the program did not finish its tests: ok (exit 0)"),
    ("def f(x):\n    return open('/etc/passwd').read()\n", "f(1) raised FileNotFoundError"),
    ("def f(x) return x\n", "solution.py: SyntaxError"),
])
def test_a_program_that_misbehaves_scores_what_it_earned(tiny_ckpt, code, told):
    if "print(sys.stdin" in code:
        code += "def f(x):\n    return None\n"
    rollout, prompts = play(tiny_ckpt, [fenced(code), fenced(code)], CodeTestsConfig(wall_s=1.0))
    assert rollout.status is RolloutStatus.COMPLETED and rollout.reward_components == {"tests": 0.0}
    assert told in prompts[1]


def test_the_dataset_is_seeded_and_its_reference_solutions_pass_their_tests(tiny_ckpt):
    try:
        env = CodeTestsEnv(CodeTestsConfig(num_samples=8, num_eval_samples=4), load_tokenizer(tiny_ckpt))
    except SandboxUnavailable as e:
        pytest.skip(f"no sandbox on this machine: {e}")
    train = env.dataset("train")
    assert train == env.dataset("train") and train != env.dataset("eval") and len(env.dataset("eval")) == 4
    assert {t["name"] for t in train} == {"f", "is_multiple", "repeat", "count_above"}
    for task in train:
        namespace = {}
        exec(task["solution"], namespace)  # noqa: S102 - the teacher's code, written by make_task
        assert all(namespace[task["name"]](*args) == expected for args, expected in task["cases"]), task
    assert env.clone().sandbox is env.sandbox
    assert extract_code("a\n```python\nx = 1\n```\nthen\n```py\nx = 2\n```") == "x = 2\n"
    assert extract_code("def f(x): return x") == "def f(x): return x"
    with pytest.raises(ConfigError, match=r"env\.args\.max_attempts: must be >= 1, got 0"):
        CodeTestsConfig(max_attempts=0)
