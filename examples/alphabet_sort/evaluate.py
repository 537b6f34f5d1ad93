"""Mean alphabet_sort reward of a checkpoint on the eval split, generated in this process.

    python examples/alphabet_sort/evaluate.py examples/alphabet_sort/warm_checkpoint
    python examples/alphabet_sort/evaluate.py runs/alphabet_sort_cpu/checkpoints/step_00000040

A training checkpoint's step dir is scored through its HF export (`hf/`).

Uses the native engine (no actors) and the rollout settings of a run config, so the number is
comparable to the training curve; `--greedy` scores the most likely replies instead of samples.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time
from pathlib import Path

from rlactors.config import load_config
from rlactors.engines import create_engine
from rlactors.engines.async_engine import AsyncEngine
from rlactors.models import load_tokenizer
from rlactors.rollout.env import load_env
from rlactors.rollout.rollouter import Rollouter

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "alphabet_sort_cpu.toml"


async def evaluate(checkpoint: Path, config_path: Path, num_prompts: int, group_size: int, greedy: bool) -> dict:
    overrides = [f'model.path="{checkpoint}"', f"rollout.group_size={group_size}"]
    if greedy:
        overrides.append("rollout.top_k=1")
    config = load_config(config_path, overrides)
    tokenizer = load_tokenizer(checkpoint)
    env = load_env(config.env, tokenizer)
    engine = AsyncEngine(create_engine(config.generator, config.model))

    async def generate(prompt, sampling, request_id, session_id=None):
        return await engine.generate(prompt, sampling, request_id)

    rollout_config = dataclasses.replace(config.rollout, keep_zero_variance_groups=True)
    rollouter = Rollouter(env, generate, rollout_config, seed=config.controller.seed)
    try:
        batch = await rollouter.collect(env.dataset("eval")[:num_prompts])
    finally:
        await engine.close()
    return batch.metrics


def hf_checkpoint(path: Path) -> Path:
    """`path` if it is an HF checkpoint dir, or the HF export of a training checkpoint's step dir."""
    for candidate in (path, path / "hf"):
        if (candidate / "config.json").is_file():
            return candidate
    raise ValueError(f"{path} is neither an HF checkpoint dir nor a training checkpoint with one in hf/ "
                     "(no config.json in either)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--greedy", action="store_true")
    args = parser.parse_args(argv)
    try:
        checkpoint = hf_checkpoint(args.checkpoint)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    start = time.monotonic()
    m = asyncio.run(evaluate(checkpoint, args.config, args.prompts, args.group_size, args.greedy))
    print(f"{checkpoint}: reward {m['rollout/reward_mean']:.3f} (std {m['rollout/reward_std']:.3f}) over "
          f"{int(m['rollout/rollouts'])} rollouts, {m['rollout/generated_tokens_mean']:.0f} tokens each, "
          f"{time.monotonic() - start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
