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

import argparse
import json
import re
import time
from pathlib import Path

import torch
from rlactors_examples.agent_tools.env import CALCULATOR, SYSTEM, AgentToolsConfig, CalculatorAgent
from rlactors_examples.alphabet_sort.warm_start import train

from rlactors.models import extend_with_messages, from_pretrained, load_tokenizer, render_messages, save_pretrained
from rlactors.models.tiny import make_tiny_checkpoint
from rlactors.rollout.types import Episode, RolloutStatus

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
    n = len(token_ids)
    return Episode(token_ids=token_ids, loss_mask=loss_mask, generator_logprobs=[0.0] * n, advantages=[0.0] * n,
                   versions=[-1] * n, group_id="sft", rollout_index=0, branch=0, reward=0.0,
                   status=RolloutStatus.COMPLETED)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.set_num_threads(1)  # the same reduction order on any machine: a reproducible checkpoint
    torch.manual_seed(args.seed)
    start = time.monotonic()
    make_tiny_checkpoint(args.out_dir, size="tiny", seed=args.seed)
    tokenizer = load_tokenizer(args.out_dir)
    model = from_pretrained(args.out_dir, dtype=torch.float32)
    rows = [json.loads(line) for line in Path(AgentToolsConfig.train_path).read_text().splitlines() if line]
    agent = CalculatorAgent(AgentToolsConfig(), tokenizer)
    answers = [s["answer"] for s in agent.dataset("train")]
    episodes = [e for row, answer in zip(rows, answers)
                if (e := demonstration(tokenizer, row["question"], row["answer"], answer)) is not None]
    print(f"{len(episodes)} demonstrations, {sum(len(e) for e in episodes)} tokens", flush=True)
    train(model, episodes, args.steps, args.batch_size, args.lr, args.seed)
    save_pretrained(model, model.args, args.out_dir)
    print(f"wrote {args.out_dir} in {time.monotonic() - start:.0f}s")


if __name__ == "__main__":
    main()
