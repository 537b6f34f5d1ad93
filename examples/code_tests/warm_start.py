"""Warm start for code_tests: supervised fine-tuning of a random tiny Qwen3 on the tasks' reference
solutions, so that it answers in a ```python block with a function of the right name and shape.
The tiny model copies the task's constants only in part, so its functions pass some tests and not
others: RL has something to improve. Deterministic: the same arguments give the same checkpoint,

    python examples/code_tests/warm_start.py runs/code_tests_warm
"""

from __future__ import annotations

from rlactors_examples.alphabet_sort.warm_start import sft_episode, warm_start_main
from rlactors_examples.code_tests.env import SYSTEM, CodeTestsConfig, CodeTestsEnv

from rlactors.models import render_messages
from rlactors.rollout.types import Episode


def demonstration(tokenizer, task: dict) -> Episode:
    """The teacher's answer to one task; its reply is the loss tokens."""
    prompt = render_messages(tokenizer, [{"role": "system", "content": SYSTEM},
                                         {"role": "user", "content": task["prompt"]}])
    reply = tokenizer.encode(f"```python\n{task['solution']}```", add_special_tokens=False) + [tokenizer.eos_token_id]
    return sft_episode(prompt + reply, [False] * len(prompt) + [True] * len(reply))


def demonstrations(tokenizer, _args) -> list[Episode]:
    return [demonstration(tokenizer, task) for task in CodeTestsEnv(CodeTestsConfig(), tokenizer).dataset("train")]


if __name__ == "__main__":
    warm_start_main(__doc__, 80, demonstrations)
