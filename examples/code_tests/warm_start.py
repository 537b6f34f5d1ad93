"""Warm start for code_tests: supervised fine-tuning of a random tiny Qwen3 on the tasks' reference
solutions, so that it answers in a ```python block with a function of the right name and shape.
The tiny model copies the task's constants only in part, so its functions pass some tests and not
others: RL has something to improve. Deterministic: the same arguments give the same checkpoint,

    python examples/code_tests/warm_start.py runs/code_tests_warm
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from rlactors_examples.alphabet_sort.warm_start import train
from rlactors_examples.code_tests.env import SYSTEM, CodeTestsConfig, CodeTestsEnv

from rlactors.models import from_pretrained, load_tokenizer, render_messages, save_pretrained
from rlactors.models.tiny import make_tiny_checkpoint
from rlactors.rollout.types import Episode, RolloutStatus


def demonstration(env: CodeTestsEnv, task: dict) -> Episode:
    """The teacher's answer to one task; its reply is the loss tokens."""
    tokenizer = env.tokenizer
    prompt = render_messages(tokenizer, [{"role": "system", "content": SYSTEM},
                                         {"role": "user", "content": task["prompt"]}])
    reply = tokenizer.encode(f"```python\n{task['solution']}```", add_special_tokens=False) + [tokenizer.eos_token_id]
    token_ids = prompt + reply
    n = len(token_ids)
    return Episode(token_ids=token_ids, loss_mask=[False] * len(prompt) + [True] * len(reply),
                   generator_logprobs=[0.0] * n, advantages=[0.0] * n, versions=[-1] * n, group_id="sft",
                   rollout_index=0, branch=0, reward=0.0, status=RolloutStatus.COMPLETED)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--steps", type=int, default=200)
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
    env = CodeTestsEnv(CodeTestsConfig(), tokenizer)
    episodes = [demonstration(env, task) for task in env.dataset("train")]
    print(f"{len(episodes)} demonstrations, {sum(len(e) for e in episodes)} tokens", flush=True)
    train(model, episodes, args.steps, args.batch_size, args.lr, args.seed)
    save_pretrained(model, model.args, args.out_dir)
    print(f"wrote {args.out_dir} in {time.monotonic() - start:.0f}s")


if __name__ == "__main__":
    main()
