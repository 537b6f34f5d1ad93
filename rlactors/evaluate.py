"""Score a checkpoint on its env's eval split, with the generator side only (router and replicas).

    python -m rlactors.evaluate CHECKPOINT [--config FILE] [--out FILE] [section.key=value ...]

CHECKPOINT is an HF checkpoint dir, a training checkpoint's step dir (scored through its `hf/`
export), or a run dir (its newest complete checkpoint). The run config is `--config`, or else the
run's own config.toml (for a step dir, or an `hf/` in one, or a run dir); a bare HF dir needs
`--config`. Its [generator] section sets the replicas (native engine on CPU, vLLM with
controller.device = "cuda", on the GPUs the run config gives them), [rollout] the turn
and token limits, [eval] the samples and sampling (greedy by default). The metrics are those of
the `eval/*` records written in training (rlactors.run.evaluation); `--out` writes them as JSON.

    python -m rlactors.evaluate runs/alphabet_sort_cpu
    python -m rlactors.evaluate examples/alphabet_sort/warm_checkpoint \
        --config configs/alphabet_sort_cpu.toml eval.samples=64
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlactors.config import Config, ConfigError, load_config
from rlactors.procs.supervision import use_fast_supervision
from rlactors.run.evaluation import Evaluator, eval_samples
from rlactors.run.generation import generate, serve_gateway, spawn_router
from rlactors.run.metrics import eval_line
from rlactors.run.run_dir import CHECKPOINTS_DIR, CONFIG_FILE
from rlactors.trainer.checkpoint import HF_DIR, is_complete, latest_checkpoint, read_state


@dataclass
class Checkpoint:
    """What CHECKPOINT names: the HF dir to load, the run config beside it (if any), and the step
    and policy version of a training checkpoint (0 for a bare HF dir)."""

    hf_dir: Path
    run_config: Path | None
    step: int = 0
    policy_version: int = 0


def resolve_checkpoint(path: Path) -> Checkpoint:
    """An HF dir, a step dir (through `hf/`), an `hf/` inside a step dir, or a run dir (its newest
    complete checkpoint); raises ValueError naming the path otherwise."""
    if not path.is_dir():
        raise ValueError(f"checkpoint {path}: no such directory")
    checkpoints = path / CHECKPOINTS_DIR
    if checkpoints.is_dir() and not (path / "config.json").is_file():
        newest = latest_checkpoint(checkpoints)
        if newest is None:
            raise ValueError(f"checkpoint {path}: a run dir without a complete checkpoint under {checkpoints}")
        path = newest
    if (path / HF_DIR / "config.json").is_file():
        step_dir = path
    elif (path / "config.json").is_file():
        step_dir = path.parent if path.name == HF_DIR else None
    else:
        raise ValueError(f"checkpoint {path}: neither an HF checkpoint dir (config.json), a training checkpoint "
                         f"(with {HF_DIR}/config.json) nor a run dir (with {CHECKPOINTS_DIR}/)")
    if step_dir is None or not is_complete(step_dir):
        return Checkpoint(path, None)
    state = read_state(step_dir)
    run_config = step_dir.parent.parent / CONFIG_FILE  # run_dir/checkpoints/step_N
    return Checkpoint(step_dir / HF_DIR, run_config if run_config.is_file() else None, int(state["step"]),
                      int(state["policy_version"]))


def load_eval_config(checkpoint: Checkpoint, config_path: Path | None, overrides: list[str]) -> Config:
    """The run config with model.path set to the checkpoint's HF dir."""
    config_path = config_path or checkpoint.run_config
    if config_path is None:
        raise ConfigError(f"--config: {checkpoint.hf_dir} is not in a run dir (no {CONFIG_FILE} to read the env "
                          "and generator settings from); name a run config with --config")
    return load_config(config_path, [*overrides, f'model.path="{checkpoint.hf_dir}"'])


async def evaluate(config: Config, checkpoint: Checkpoint, progress: bool = True) -> dict[str, float]:
    """Starts the router and replicas of `config`, scores the eval split, stops them."""
    import monarch.actor
    from tqdm import tqdm

    from rlactors.models import load_checked_tokenizer
    from rlactors.rollout.env import load_env

    tokenizer = load_checked_tokenizer(config.model.path)
    env = load_env(config.env, tokenizer)
    samples = eval_samples(env, config.env.name, config.eval)  # fails before any proc starts
    # Monarch's default for a fault nobody handled is to kill this process: the failing call raises instead.
    monarch.actor.unhandled_fault_hook = lambda failure: logging.getLogger(__name__).error("Monarch fault: %s", failure)
    procs, router = spawn_router(config)
    gateway = await serve_gateway(env, config, tokenizer)
    # The replicas load the checkpoint as their version 0: their versions count from its policy version.
    evaluator = Evaluator(env, functools.partial(generate, router, base_version=checkpoint.policy_version),
                          config.rollout, config.eval, samples)
    bar = tqdm(total=evaluator.num_rollouts, desc="eval", unit="rollout", disable=not progress)
    try:
        return await evaluator.evaluate(checkpoint.step, checkpoint.policy_version, on_rollout=lambda _: bar.update())
    finally:
        bar.close()
        try:
            if gateway is not None:
                await gateway.stop()
            await router.close.call_one()
        finally:
            await procs.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlactors.evaluate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="an HF dir, a training checkpoint's step dir, or a run dir")
    parser.add_argument("--config", type=Path, help="the run config (default: the run's config.toml)")
    parser.add_argument("--out", type=Path, help="write the metrics here as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. eval.samples=64")
    args = parser.parse_intermixed_args(argv)  # options may come between CHECKPOINT and the overrides
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    use_fast_supervision()  # poll procs every second, hold back Monarch's own verdict; before Monarch starts
    try:
        checkpoint = resolve_checkpoint(args.checkpoint)
        config = load_eval_config(checkpoint, args.config, args.overrides)
        metrics = asyncio.run(evaluate(config, checkpoint, progress=not args.no_progress))
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for key in sorted(metrics):
        print(f"{key} {metrics[key]:.6g}")
    print(f"{checkpoint.hf_dir}: {eval_line(checkpoint.step, metrics)}")
    if args.out is not None:
        record: dict[str, Any] = {"checkpoint": str(checkpoint.hf_dir), "step": checkpoint.step, **metrics}
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    from rlactors.procs.supervision import exit_after_client_shutdown

    exit_after_client_shutdown(main())
