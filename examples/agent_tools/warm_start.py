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
the 500 problems' answers. `--until-accuracy A` stops it at the first check, every
`--check-every` steps, whose greedy accuracy over whole agent episodes (`--config`'s env and
limits, through a gateway) on the last `--check-problems` train problems, left out of the
demonstrations, is at least A: room for RL to improve. The run is deterministic: the same
arguments give the same checkpoint,

    python examples/agent_tools/warm_start.py examples/agent_tools/warm_checkpoint
    python examples/agent_tools/warm_start.py runs/agent_tools_warm_gpu --size small --steps 1500 \
        --batch-size 64 --variants 16 --until-accuracy 0.3 --check-every 25 --device cuda
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import json
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rlactors_examples.agent_tools.env import CALCULATOR, SYSTEM, AgentToolsConfig, CalculatorAgent, calculate
from rlactors_examples.alphabet_sort.warm_start import sft_episode, warm_start_main

from rlactors.config import (
    Config,
    ConfigError,
    EnvConfig,
    EvalConfig,
    GatewayConfig,
    GeneratorConfig,
    RolloutConfig,
    build_dataclass,
    read_toml,
)
from rlactors.engines.async_engine import AsyncEngine
from rlactors.engines.native import NativeEngine
from rlactors.gateway import serve_agent_env
from rlactors.models import extend_with_messages, render_messages
from rlactors.models.args import DTYPES
from rlactors.rollout.env import load_env
from rlactors.rollout.types import Episode
from rlactors.run.evaluation import Evaluator

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
    its place (fewer where draws fail: 20 draws a copy); with `--until-accuracy`, not the last
    `--check-problems` problems, which the checks score."""
    rows = [json.loads(line) for line in Path(AgentToolsConfig.train_path).read_text().splitlines() if line]
    agent = CalculatorAgent(AgentToolsConfig(), tokenizer)
    answers = [s["answer"] for s in agent.dataset("train")]
    held_out = args.check_problems if args.until_accuracy is not None else 0
    if held_out >= len(rows):
        raise SystemExit(f"error: --check-problems {held_out}: the train split has only {len(rows)} problems")
    rows, answers = rows[:len(rows) - held_out], answers[:len(answers) - held_out]
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


def held_out_problems(tokenizer, count: int) -> list[dict[str, Any]]:
    """The problems the accuracy checks score: the last `count` of the train split (the run's eval
    split is never seen before the run reports it)."""
    return CalculatorAgent(AgentToolsConfig(), tokenizer).dataset("train")[-count:]


@dataclass(frozen=True)
class Episodes:
    """What the checks' episodes follow, from a run config: its env, [rollout] limits, [gateway]
    bounds (served on a free local port) and model.dtype."""

    env: EnvConfig
    rollout: RolloutConfig
    gateway: GatewayConfig
    dtype: torch.dtype

    @classmethod
    def of(cls, run_config: Path) -> Episodes:
        """Raises ConfigError, naming the key, for a config a run could not be built from (its
        model.path aside: the warm start writes it)."""
        tree = read_toml(run_config)
        config = build_dataclass(Config, {**tree, "model": {**tree.get("model", {}), "path": "."}})
        return cls(config.env, config.rollout, dataclasses.replace(config.gateway, host="127.0.0.1", port=0),
                   DTYPES[config.model.dtype])


def agent_accuracy(model, tokenizer, episodes: Episodes, problems: list[dict[str, Any]]) -> dict[str, float]:
    """The greedy `eval/*` metrics of `model` as the agent on `problems`: whole episodes of the env
    through a gateway, under the rollout limits, played as the run's evaluation plays them, by a
    native engine in this process on a copy of the model in `episodes.dtype`. The copy runs
    batch-invariant kernels: a reply does not depend on which episodes share an engine step, so
    the same weights always score the same."""
    max_model_len = episodes.rollout.max_total_tokens
    sizes = GeneratorConfig(max_num_seqs=len(problems), kv_cache_tokens=len(problems) * max_model_len,
                            max_model_len=max_model_len)

    async def play() -> dict[str, float]:
        engine = AsyncEngine(NativeEngine(copy.deepcopy(model).to(episodes.dtype), sizes, true_on_policy=True))
        env = load_env(episodes.env, tokenizer)
        gateway = await serve_agent_env(env, episodes.gateway, episodes.rollout.max_tokens_per_turn, tokenizer)

        async def generate(prompt_token_ids, sampling, request_id, session_id=None):
            return await engine.generate(prompt_token_ids, sampling, request_id)
        try:
            return await Evaluator(env, generate, episodes.rollout, EvalConfig(), problems).evaluate(0, 0)
        finally:
            await gateway.stop()
            await engine.close()
    return asyncio.run(play())


def stop_at(threshold: float, every: int, accuracy: Callable[[int], float]) -> Callable[[int], bool]:
    """A `train` stop: every `every` steps, whether `accuracy(step)` is at least `threshold`."""
    return lambda step: step % every == 0 and accuracy(step) >= threshold


def stop_at_accuracy(model, tokenizer, args: argparse.Namespace) -> Callable[[int], bool] | None:
    """With `--until-accuracy`, the stop at the first check whose accuracy on the held-out train
    problems reaches it; every check is printed. An episode that ends in error fails the warm start:
    its accuracy would not be the policy's."""
    if args.until_accuracy is None:
        return None
    try:
        episodes = Episodes.of(args.config)
    except ConfigError as e:
        raise SystemExit(f"error: --config {args.config}: {e}") from None
    problems = held_out_problems(tokenizer, args.check_problems)

    def accuracy(step: int) -> float:
        start = time.monotonic()
        metrics = agent_accuracy(model, tokenizer, episodes, problems)
        errors = {k: v for k, v in metrics.items() if k.startswith("eval/status/error") and v}
        if errors:
            raise RuntimeError(f"accuracy check at step {step}: episodes ended in error: {errors}")
        value = metrics["eval/reward/correct_mean"]
        print(f"check at step {step}: accuracy {value:.3f} on {len(problems)} held-out train problems, "
              f"tool calls {metrics['eval/reward/tool_call_mean']:.3f}, {time.monotonic() - start:.0f}s", flush=True)
        return value
    return stop_at(args.until_accuracy, args.check_every, accuracy)


def share(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--variants", type=int, default=0,
                        help="renumbered copies of each training problem, in its place")
    parser.add_argument("--until-accuracy", type=share,
                        help="stop at the first check whose greedy accuracy on the held-out train problems is at "
                             "least this (still at most --steps)")
    parser.add_argument("--check-every", type=positive, default=50, help="SFT steps between accuracy checks")
    parser.add_argument("--check-problems", type=positive, default=100,
                        help="the last this many train problems: held out of the demonstrations, scored by the checks")
    parser.add_argument("--config", type=Path, default=Path("configs/agent_tools_1gpu.toml"),
                        help="the run config whose env, [rollout], [gateway] and model.dtype the checks' episodes "
                             "follow")


def main(argv: list[str] | None = None) -> None:
    warm_start_main(__doc__, 300, demonstrations, add_arguments, stop_at_accuracy, argv)


if __name__ == "__main__":
    main()
