"""Train a policy with GRPO on Monarch actors: the library's command line.

    python -m rlactors.train --config configs/alphabet_sort_cpu.toml
    python -m rlactors.train --config configs/math_1gpu.toml model.path=/models/Qwen3-1.7B
    python -m rlactors.train --config my_run.toml env.name=my_envs.echo:EchoEnv controller.mode=async
    python -m rlactors.train --config my_run.toml --resume           # from the last complete checkpoint

Overrides are `section.key=value` (TOML values) on top of the config file (or of the defaults);
`model.path` has no default. Metrics, samples, env errors (env_errors.log), TensorBoard logs,
checkpoints and reward_curve.png go to controller.run_dir, which holds one run: a new run there is
refused once it holds steps (continue it with --resume). Ctrl-C saves the last completed step.
Exit codes: 0 done, 2 a bad config or input or a run that cannot go on (one `error:` line), 130
interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from pathlib import Path


def main(argv: Sequence[str] | None = None, default_config: Path | None = None) -> int:
    """Runs the command line `argv` (default: sys.argv[1:]); `default_config` is the file used
    without --config (none: the Config defaults)."""
    parser = argparse.ArgumentParser(prog=None if default_config else "python -m rlactors.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("--config", type=Path, default=default_config,
                        help=f"TOML config (default: {default_config or 'the Config defaults'})")
    parser.add_argument("--resume", action="store_true", help="continue from the last complete checkpoint")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    args = parser.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    from rlactors.supervision import use_fast_supervision

    use_fast_supervision()  # poll procs every second, hold back Monarch's own verdict; before Monarch starts

    from rlactors.config import ConfigError, load_config
    from rlactors.controller import NO_SIGNAL_HINT, Controller, TrainingError
    from rlactors.metrics import EVAL_REWARD_MEAN, read_metrics

    controller = None
    try:
        config = load_config(args.config, args.overrides)
        controller = Controller(config, resume=args.resume)
        history = asyncio.run(controller.run())
    except (ConfigError, TrainingError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if controller is None or controller.interrupt_report is None:  # else the controller said what it kept
            print("interrupted", file=sys.stderr)
        return 130
    rewards = [m["rollout/reward_mean"] for m in history if "rollout/reward_mean" in m]
    if rewards:
        untrained = sum(m["train/trained"] == 0 for m in history)
        trained = f"; {untrained} of them trained nothing (see their step lines)" if untrained else ""
        print(f"done: {len(history)} steps, reward {rewards[0]:.3f} -> {rewards[-1]:.3f}{trained}; "
              f"run dir {config.controller.run_dir}")
        evals = [r for r in read_metrics(config.controller.run_dir) if EVAL_REWARD_MEAN in r]
        if evals:
            first, last = min(evals, key=lambda r: r["step"]), max(evals, key=lambda r: r["step"])
            sampling = "greedy" if config.eval.temperature == 0 else f"temperature {config.eval.temperature:g}"
            print(f"eval reward {first[EVAL_REWARD_MEAN]:.3f} at step {first['step']} -> {last[EVAL_REWARD_MEAN]:.3f} "
                  f"at step {last['step']} ({last['eval/samples']:.0f} held-out samples, {sampling})")
        if all(m["rollout/groups_dropped"] == m["rollout/groups"] for m in history):
            print(f"no step trained: the rollouts of each group earned equal rewards, so GRPO had nothing to "
                  f"learn from; {NO_SIGNAL_HINT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
