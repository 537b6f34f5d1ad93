"""alphabet_sort end to end: seconds per step split into rollout / train / weight sync / idle,
sync vs async (bounded staleness) on the same config, and async against its ideal bound.

    python benchmarks/e2e_alphabet_sort.py --steps 8                                  # CPU demo config
    python benchmarks/e2e_alphabet_sort.py --config configs/alphabet_sort_4gpu.toml --steps 10
    python benchmarks/e2e_alphabet_sort.py --steps 8 --staleness 1 2 --tool-latency 1.0

Runs the controller in sync mode, then in async mode once per `--staleness` bound (default: the
config's max_staleness), skips the first step of each (start-up), and adds a row of medians per
run to benchmarks/results/e2e_alphabet_sort.md (results_table.py). The ideal async speedup
(in brackets) is measured in the same invocation: a sync step's rollout wait (T_gen) and the rest
of it (T_train) overlapped perfectly, (T_gen + T_train) / max(T_gen, T_train). Overrides after
the options apply to every run.
`--tool-latency S` makes every env turn wait S seconds before it is scored, as a tool call or a
sandbox run would: rollouts then wait on the env, as in agentic RL, more than on compute.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from results_table import RESULTS, append_row
from rlactors_examples.alphabet_sort.env import AlphabetSortConfig, AlphabetSortEnv

from rlactors.config import load_config
from rlactors.procs.supervision import use_fast_supervision
from rlactors.run.controller import Controller

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "alphabet_sort_cpu.toml"
COLUMNS = ("config", "mode", "s/step", "rollout s", "train s", "weight sync s", "trainer idle", "generator idle", "age",
           "reward", "steps/s", "steps/s against sync (ideal)")
SPLIT = ("time/step_s", "time/rollout_wait_s", "time/train_s", "time/weight_sync_s", "time/trainer_idle_fraction")


@dataclass
class ToolLatencyConfig(AlphabetSortConfig):
    tool_latency_s: float = 0.0  # how long each turn waits before it is scored


class ToolLatencyAlphabetSort(AlphabetSortEnv):
    """alphabet_sort whose every turn first waits `tool_latency_s`, as a tool call would."""

    Config = ToolLatencyConfig

    async def respond(self, reply, completion):
        await asyncio.sleep(self.config.tool_latency_s)
        return await super().respond(reply, completion)


def run(config_path: Path, steps: int, overrides: list[str]) -> list[dict[str, float]]:
    run_dir = tempfile.mkdtemp(prefix="rlactors_e2e_")
    # No evaluation: the demo configs' evals would share the replicas with the steps timed here.
    config = load_config(config_path, [*overrides, f"controller.steps={steps}", f'controller.run_dir="{run_dir}"',
                                       "controller.checkpoint_every=0", "controller.eval_every=0"])
    return asyncio.run(Controller(config).run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--staleness", type=int, nargs="+", help="async runs' max_staleness (default: the config's)")
    parser.add_argument("--tool-latency", type=float, default=0.0, help="seconds each env turn waits (alphabet_sort)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    use_fast_supervision()
    overrides = list(args.overrides)
    if args.tool_latency:
        overrides += [f'env.name="{ToolLatencyAlphabetSort.__module__}:ToolLatencyAlphabetSort"',
                      f"env.args.tool_latency_s={args.tool_latency}"]

    runs = {"sync": ["controller.mode=sync"]}
    for bound in args.staleness or [None]:
        name = "async" if bound is None else f"async, staleness {bound}"
        runs[name] = ["controller.mode=async"] + ([] if bound is None else [f"controller.max_staleness={bound}"])
    medians = {}
    for name, mode in runs.items():
        history = run(args.config, args.steps, overrides + mode)[1:]
        medians[name] = {k: statistics.median(m[k] for m in history) for k in SPLIT}
        medians[name]["age"] = statistics.fmean(m["policy/age_mean"] for m in history)
        medians[name]["reward"] = statistics.fmean(m["rollout/reward_mean"] for m in history)
        idle = [m["time/generator_idle_fraction"] for m in history if "time/generator_idle_fraction" in m]
        medians[name]["generator_idle"] = f"{statistics.median(idle):.2f}" if idle else "n/a"
    # Async at best overlaps generation with the rest of a sync step: (T_gen + T_train) / max(T_gen, T_train),
    # T_gen = a sync step's wait for rollouts, T_train = the rest of it (train, weight sync, bookkeeping).
    sync = medians["sync"]
    t_gen = sync["time/rollout_wait_s"]
    t_train = sync["time/step_s"] - t_gen
    ideal = sync["time/step_s"] / max(t_gen, t_train)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for name, m in medians.items():
        speedup = sync["time/step_s"] / m["time/step_s"]
        against_sync = "-" if name == "sync" else f"**{speedup:.2f}x** ({ideal:.2f}x: {speedup / ideal:.2f} of it)"
        row = append_row(RESULTS / "e2e_alphabet_sort.md", "alphabet_sort end to end: sync vs async", COLUMNS,
                         [args.config.name, name, f"{m['time/step_s']:.2f}", f"{m['time/rollout_wait_s']:.2f}",
                          f"{m['time/train_s']:.2f}", f"{m['time/weight_sync_s']:.3f}",
                          f"{m['time/trainer_idle_fraction']:.2f}", m["generator_idle"], f"{m['age']:.2f}",
                          f"{m['reward']:.3f}", f"{1 / m['time/step_s']:.3f}", against_sync], device=device)
        print(row)


if __name__ == "__main__":
    main()
