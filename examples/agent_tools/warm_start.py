"""Warm start for the agent demo: supervised fine-tuning of a random tiny Qwen3 on a teacher that
works each math problem with the calculator tool.

A random tiny model never writes a `<tool_call>`, so the agent would never use its tool and every
answer would be wrong. The teacher's demonstrations are whole agent conversations, rendered the
way the gateway renders them (the tools in the system turn, each reply followed by the tool's
result): one calculator call per step of the reference solution (`5 * 15`, then `15 + 75`), then
`The answer is N.`. Problems whose solution has no such steps are left out. The warm policy learns
the format and to copy numbers from the question only in part, so its answers are sometimes right:
RL has something to improve. `--variants N` puts N renumbered copies of each problem in its place,
worked by the same teacher: a longer warm start then learns to copy numbers rather than recite
the 500 problems' answers, and the RL run's problems keep numbers it has not seen. The run is
deterministic: the same arguments give the same checkpoint,

    python examples/agent_tools/warm_start.py examples/agent_tools/warm_checkpoint
    python examples/agent_tools/warm_start.py runs/agent_tools_warm_gpu --size small --steps 3000 \
        --batch-size 64 --variants 16 --device cuda    # configs/agent_tools_1gpu.toml's policy
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

from rlactors_examples.agent_tools.env import CALCULATOR, SYSTEM, AgentToolsConfig, CalculatorAgent, calculate
from rlactors_examples.alphabet_sort.warm_start import sft_episode, warm_start_main

from rlactors.models import extend_with_messages, render_messages
from rlactors.rollout.types import Episode

STEP = re.compile(r"(\d+(?: [-+*/] \d+)+) = \$?(\d+)")  # "5 * 15 = 75" in a reference solution
NUMBER = re.compile(r"\d+")


def tool_call_text(expression: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + \
        "\n</tool_call>"


def renumbered(question: str, steps: list[tuple[str, str]], answer: str,
               rng: random.Random) -> tuple[str, list[tuple[str, str]], str] | None:
    """The problem with new numbers: each number of the question drawn between half and twice its
    value, the same steps recomputed on them. None when a step's value is no longer a whole number
    >= 0, or when the steps cannot be followed (a result that equals a number of the question)."""
    if answer != steps[-1][1]:
        return None
    new = {n: str(rng.randint(max(1, int(n) // 2), max(2, 2 * int(n)))) for n in NUMBER.findall(question)}
    renumbered_steps = []
    for expression, result in steps:
        if result in new:
            return None
        expression = NUMBER.sub(lambda m: new.get(m.group(), m.group()), expression)
        new[result] = calculate(expression)
        if not new[result].isdigit():
            return None
        renumbered_steps.append((expression, new[result]))
    return NUMBER.sub(lambda m: new[m.group()], question), renumbered_steps, new[answer]


def demonstration(tokenizer, question: str, steps: list[tuple[str, str]], answer: str) -> Episode:
    """The teacher's conversation for one problem: a calculator call per step of its solution
    (`steps`: (expression, value)), then the answer; its replies are the loss tokens."""
    eos = tokenizer.eos_token_id
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    token_ids = render_messages(tokenizer, messages, tools=[CALCULATOR])
    loss_mask = [False] * len(token_ids)
    for expression, result in steps:
        call = tokenizer.encode(tool_call_text(expression), add_special_tokens=False) + [eos]
        token_ids, loss_mask = token_ids + call, loss_mask + [True] * len(call)
        tool = {"role": "tool", "tool_call_id": "c", "content": result}
        extended = extend_with_messages(tokenizer, token_ids, [tool], tools=[CALCULATOR])
        loss_mask += [False] * (len(extended) - len(token_ids))
        token_ids = extended
    final = tokenizer.encode(f"The answer is {answer}.", add_special_tokens=False) + [eos]
    token_ids, loss_mask = token_ids + final, loss_mask + [True] * len(final)
    return sft_episode(token_ids, loss_mask)


def demonstrations(tokenizer, args: argparse.Namespace) -> list[Episode]:
    """Each training problem whose solution has steps, or `args.variants` renumbered copies of it in
    its place (fewer where draws fail: 20 draws a copy)."""
    rows = [json.loads(line) for line in Path(AgentToolsConfig.train_path).read_text().splitlines() if line]
    agent = CalculatorAgent(AgentToolsConfig(), tokenizer)
    answers = [s["answer"] for s in agent.dataset("train")]
    rng = random.Random(args.seed)
    episodes = []
    for row, answer in zip(rows, answers):
        if not (steps := STEP.findall(row["answer"])):
            continue
        problems = [] if args.variants else [(row["question"], steps, answer)]
        for _ in range(args.variants):
            draws = (renumbered(row["question"], steps, answer, rng) for _ in range(20))
            problems += [p] if (p := next((p for p in draws if p), None)) else []
        episodes += [demonstration(tokenizer, *problem) for problem in problems]
    return episodes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--variants", type=int, default=0,
                        help="renumbered copies of each training problem, in its place")


if __name__ == "__main__":
    warm_start_main(__doc__, 300, demonstrations, add_arguments)
