"""Train a policy with GRPO on Monarch actors: the library's command line.

    python -m rlactors.train --config configs/alphabet_sort_cpu.toml
    python -m rlactors.train --config configs/math_1gpu.toml model.path=/models/Qwen3-1.7B
    python -m rlactors.train --config my_run.toml env.name=my_envs.echo:EchoEnv controller.mode=async
    python -m rlactors.train --resume controller.run_dir=runs/my_run      # from its last intact checkpoint
    python -m rlactors.train --config configs/qwen3_32b_8gpu.toml --plan   # memory per GPU; spawns nothing

Overrides are `section.key=value` (TOML values) on top of the config file (or of the defaults);
`model.path` has no default. `--resume` starts from the run dir's own config.toml, with --config's
keys and the overrides on top (docs/checkpoints.md). Metrics, samples, env errors (env_errors.log), TensorBoard logs,
checkpoints and reward_curve.png go to controller.run_dir, which holds one run: a new run there is
refused once it holds steps (continue it with --resume). Ctrl-C saves the last completed step.
Exit codes: 0 done, 2 a bad config or input or a run that cannot go on (one `error:` line), 130
interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlactors.config import Config
    from rlactors.run.controller import Controller


def main(argv: Sequence[str] | None = None, default_config: Path | None = None) -> int:
    """Runs the command line `argv` (default: sys.argv[1:]); `default_config` is the file used
    without --config (none: the Config defaults)."""
    parser = argparse.ArgumentParser(prog=None if default_config else "python -m rlactors.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("--config", type=Path, default=None,
                        help=f"TOML config (default: {default_config or 'the Config defaults'}; "
                             "with --resume: the run dir's config.toml)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the last intact checkpoint (none: from step 0), with the run's config")
    parser.add_argument("--plan", action="store_true",
                        help="print the memory plan per GPU (rlactors.run.memory_plan) and exit; exit code 2 when "
                             "the run cannot fit")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    args = parser.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    from rlactors.procs.supervision import use_fast_supervision

    use_fast_supervision()  # poll procs every second, hold back Monarch's own verdict; before Monarch starts

    from rlactors.config import ConfigError, load_config
    from rlactors.run.controller import Controller, TrainingError
    from rlactors.run.metrics import EVAL_REWARD_MEAN, NO_SIGNAL_HINT, REWARD_MEAN, read_metrics, reward_trend

    if args.plan:
        return print_plan(args.config or default_config, args.overrides)
    controller = None
    try:
        config = load_resumed_config(args, default_config) if args.resume else \
            load_config(args.config or default_config, args.overrides)
        controller = Controller(config, resume=args.resume)
        history = run_controller(controller)
    except (ConfigError, TrainingError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if controller is None or controller.interrupt_report is None:  # else the controller said what it kept
            print("interrupted", file=sys.stderr)
        return 130
    # The whole run's steps (a resumed run's metrics.jsonl holds those before the resume too).
    records = read_metrics(config.controller.run_dir) if history else []
    steps = [r for r in records if REWARD_MEAN in r]
    if steps:
        untrained = sum(r["train/trained"] == 0 for r in steps)
        trained = f"; {untrained} of them trained nothing (see their step lines)" if untrained else ""
        resumed = steps[-1]["step"] - len(history)
        session = f" ({len(history)} in this session, resumed after step {resumed})" if resumed else ""
        print(f"done: {len(steps)} steps{session}, {reward_trend(steps)}{trained}; run dir {config.controller.run_dir}")
        evals = [r for r in records if EVAL_REWARD_MEAN in r]
        if evals:
            first, last = min(evals, key=lambda r: r["step"]), max(evals, key=lambda r: r["step"])
            sampling = "greedy" if config.eval.temperature == 0 else f"temperature {config.eval.temperature:g}"
            print(f"eval reward {first[EVAL_REWARD_MEAN]:.3f} at step {first['step']} -> {last[EVAL_REWARD_MEAN]:.3f} "
                  f"at step {last['step']} ({last['eval/samples']:.0f} held-out samples, {sampling})")
        if all(r["rollout/groups_dropped"] == r["rollout/groups"] for r in steps):
            print(f"no step trained: the rollouts of each group earned equal rewards, so GRPO had nothing to "
                  f"learn from; {NO_SIGNAL_HINT}")
    return 0


def load_resumed_config(args: argparse.Namespace, default_config: Path | None) -> Config:
    """A --resume's config: the run dir's config.toml, then --config's keys, then the overrides
    (only a run dir without one takes the default config)."""
    from rlactors.config import load_config
    from rlactors.run.run_dir import saved_config

    base = saved_config(args.config or default_config, args.overrides)
    return load_config(args.config or (None if base else default_config), args.overrides, base=base)


def print_plan(path: Path | None, overrides: Sequence[str]) -> int:
    """Prints the memory plan of the config at `path` for the GPUs it asks for, whether or not
    this machine has them; 2 (and one `error:` line) when it cannot fit or the config is bad."""
    from rlactors.config import ConfigError, load_config
    from rlactors.models.checkpoint import load_args
    from rlactors.run.memory_plan import gpu_gib, plan

    try:
        config = load_config(path, overrides, available_gpus=sys.maxsize)
        memory = plan(config, load_args(config.model.path), gpu_gib(config))
        print(memory.table())
        memory.check()
    except (ConfigError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def run_controller(controller: Controller) -> list[dict[str, float]]:
    """`controller.run()` on an event loop of its own, with Ctrl-C in two steps that hold even
    while a call blocks the loop: the first cancels the run (Controller.run saves the last
    completed step) and, when the loop is blocked, says where; the second quits at once, naming
    the last complete checkpoint (the actor procs end with this process)."""
    from rlactors.trainer.checkpoint import latest_checkpoint

    with asyncio.Runner() as runner:  # closing it cancels what is left, as asyncio.run does
        loop = runner.get_loop()
        task = loop.create_task(controller.run())
        interrupts = 0

        def on_sigint(signum: int, frame: FrameType | None) -> None:
            nonlocal interrupts
            interrupts += 1
            if interrupts == 1:
                loop.call_soon_threadsafe(task.cancel)  # runs once the loop does
                if controller.watchdog.blocked_for() >= 1.0:
                    print(f"interrupted: the event loop is blocked in {controller.watchdog.where(frame)}; the run "
                          "stops once that call returns (Ctrl-C again to quit at once)", file=sys.stderr, flush=True)
                return
            last = latest_checkpoint(controller.run_dir.checkpoints)
            kept = f"the last complete checkpoint is {last}; continue with --resume" if last else "nothing is saved"
            print(f"interrupted again: quitting at once; {kept}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            controller.meshes.release_hosts()  # a Slurm allocation outlives this process otherwise
            os._exit(130)

        async def until_done() -> list[dict[str, float]]:
            return await task

        # Set before runner.run, which then keeps it instead of installing asyncio's own.
        previous = signal.signal(signal.SIGINT, on_sigint)
        try:
            return runner.run(until_done())
        except asyncio.CancelledError:
            raise KeyboardInterrupt from None
        finally:
            signal.signal(signal.SIGINT, previous)

if __name__ == "__main__":
    from rlactors.procs.supervision import exit_after_client_shutdown

    exit_after_client_shutdown(main())
