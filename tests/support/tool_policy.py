"""A tiny policy that has memorised one tool-calling conversation, for the gateway tests.

A random tiny model never writes a `<tool_call>`. A few hundred supervised steps on one
conversation (question -> calculator call; tool result -> answer) make it reply exactly so, at
any sampling temperature the tests use: a real policy that calls tools, served by the real engine.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from rlactors.models import extend_with_messages, from_pretrained, load_tokenizer, render_messages, save_pretrained

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluates an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
SYSTEM = "You are a careful assistant. Use the calculator for arithmetic."
QUESTION = "What is 17 * 23?"
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 * 23"}}\n</tool_call>'
RESULT = "391"
ANSWER = "The answer is 391."


def conversation() -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]


def demonstration(tokenizer) -> tuple[list[int], list[bool]]:
    """The whole conversation's tokens, as a rollout of it holds them, and which are the replies."""
    eos = tokenizer.eos_token_id
    ids = render_messages(tokenizer, conversation(), tools=TOOLS)
    mask = [False] * len(ids)
    call = tokenizer.encode(CALL, add_special_tokens=False) + [eos]
    ids, mask = ids + call, mask + [True] * len(call)
    extended = extend_with_messages(tokenizer, ids, [{"role": "tool", "tool_call_id": "c", "content": RESULT}],
                                    tools=TOOLS)
    mask += [False] * (len(extended) - len(ids))
    answer = tokenizer.encode(ANSWER, add_special_tokens=False) + [eos]
    return extended + answer, mask + [True] * len(answer)


def train_tool_policy(base: Path, out: Path, steps: int = 200, lr: float = 5e-3) -> Path:
    torch.manual_seed(0)
    tokenizer = load_tokenizer(base)
    model = from_pretrained(base, dtype=torch.float32)
    ids, mask = demonstration(tokenizer)
    inputs, targets = torch.tensor(ids[:-1]), torch.tensor(ids[1:])
    trained = torch.tensor(mask[1:])
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    # One intra-op thread: as fast on these tiny matrices, and two threads that contend with other
    # processes for a 2-core box's cores make each step 10-25x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(steps):
            logprobs = model.token_logprobs(model.forward_packed(inputs, torch.arange(len(inputs))), targets)
            loss = -logprobs[trained].mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        torch.set_num_threads(threads)
    out.mkdir(parents=True, exist_ok=True)
    save_pretrained(model, model.args, out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(base / name, out / name)
    return out
