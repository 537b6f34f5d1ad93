"""Warm start for the agent demo: supervised fine-tuning of a random tiny Qwen3 on a teacher that
works each math problem with the calculator tool.

A random tiny model never writes a `<tool_call>`, so the agent would never use its tool and every
answer would be wrong. The teacher's demonstrations are whole agent conversations, rendered the
way the gateway renders them (the tools in the system turn, each reply followed by the tool's
result): one calculator call per step of the reference solution (`5 * 15`, then `15 + 75`), then
`The answer is N.`. Problems whose solution has no such steps are left out. The warm policy learns
the format and to copy numbers from the question only in part, so its answers are sometimes right:
RL has something to improve. The run is deterministic: the same arguments give the same checkpoint,

    python examples/agent_tools/warm_start.py examples/agent_tools/warm_checkpoint
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from rlactors_examples.agent_tools.env import CALCULATOR, SYSTEM, AgentToolsConfig, CalculatorAgent
from rlactors_examples.alphabet_sort.warm_start import sft_episode, warm_start_main

from rlactors.models import extend_with_messages, render_messages
from rlactors.rollout.types import Episode

STEP = re.compile(r"(\d+(?: [-+*/] \d+)+) = \$?(\d+)")  # "5 * 15 = 75" in a reference solution


def tool_call_text(expression: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + \
        "\n</tool_call>"


def demonstration(tokenizer, question: str, solution: str, answer: str) -> Episode | None:
    """The teacher's conversation for one problem; its replies are the loss tokens."""
    steps = STEP.findall(solution)
    if not steps:
        return None
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


def demonstrations(tokenizer) -> list[Episode]:
    rows = [json.loads(line) for line in Path(AgentToolsConfig.train_path).read_text().splitlines() if line]
    agent = CalculatorAgent(AgentToolsConfig(), tokenizer)
    answers = [s["answer"] for s in agent.dataset("train")]
    return [e for row, answer in zip(rows, answers)
            if (e := demonstration(tokenizer, row["question"], row["answer"], answer)) is not None]


if __name__ == "__main__":
    warm_start_main(__doc__, 300, demonstrations)
