"""In-job trainer recovery (`controller.restart_trainer`): a CPU run whose trainer ranks are
SIGKILLed, and how long it takes from each kill to training again.

    .venv/bin/python benchmarks/trainer_recovery.py                  # 2 ranks, 2 kills, 6 steps
    .venv/bin/python benchmarks/trainer_recovery.py --ranks 1 --kills 3 --steps 8

The run is the Controller in this process on a tiny random Qwen3 with the fault suite's small CPU
config (tests/faults/faultkit.py: one replica, FaultyEnv without faults), `controller.checkpoint_every=2`
and `controller.restart_trainer` = --kills. As steps 2, 4, 6, ... begin (the step after each
checkpoint interval's first step), a trainer rank's OS process is SIGKILLed, rank 0, 1, ... in
turn (`faultkit.TrainerKilledAsStepsBegin`). Per kill it reports the seconds until the rebuilt
trainer holds the checkpoint and the generators its policy ("rebuilt"), and until the next step
completes ("a step again"); the step's rollouts, already under way at the kill, finish before the
trainer's death stops it. The run must complete with every step recorded exactly once in
metrics.jsonl and samples.jsonl. Appends a row to the "In-job trainer recovery" section at the end
of results/faults.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from results_table import commit, machine

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "faults"))  # faultkit, and fault_envs for env.name

OUT = REPO / "benchmarks" / "results" / "faults.md"
SECTION = "## In-job trainer recovery (controller.restart_trainer)"
HEADER = [SECTION, "",
          "`benchmarks/trainer_recovery.py`: a CPU run (tiny random Qwen3, `controller.checkpoint_every=2`) whose "
          "trainer ranks are SIGKILLed as steps 2, 4, ... begin; seconds from each kill until the rebuilt trainer "
          "holds the checkpoint and the generators its policy, and until the next step completes. Most of a "
          "rebuild is starting the new trainer's procs, as slow as the run's first start on a loaded machine: the "
          "load column is the machine's 1-minute load average as the run began.",
          "", "| machine, date, commit | load | command | ranks | steps | kills | kill to rebuilt (s) "
          "| kill to a step again (s) | completed | every step recorded once |",
          "|---|---|---|---|---|---|---|---|---|---|"]


def recorded_once(run_dir: Path, steps: int) -> bool:
    """Every step of 1..steps has one record in metrics.jsonl and as many in samples.jsonl as the others."""
    def steps_in(name: str) -> list[int]:
        return [json.loads(line)["step"] for line in (run_dir / name).read_text().splitlines() if line.strip()]

    samples = steps_in("samples.jsonl")
    counts = {samples.count(s) for s in range(1, steps + 1)}
    return steps_in("metrics.jsonl") == list(range(1, steps + 1)) and sorted(samples) == samples and counts != {0} \
        and len(counts) == 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2, help="trainer ranks (default 2)")
    parser.add_argument("--kills", type=int, default=2, help="SIGKILLs, as steps 2, 4, ... begin (default 2)")
    parser.add_argument("--steps", type=int, default=6, help="controller.steps (default 6)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if args.kills < 1 or 2 * args.kills > args.steps:
        parser.error("--kills: at least 1, as steps 2, 4, ... begin: --steps >= 2 x --kills")

    from rlactors.procs.supervision import use_fast_supervision

    use_fast_supervision()  # as the command line does, before Monarch starts
    from faultkit import TrainerKilledAsStepsBegin, small_run_overrides

    from rlactors.config import load_config
    from rlactors.models.tiny import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_checkpoint(Path(tmp) / "ckpt", size="tiny", seed=0, tie_word_embeddings=True, family="qwen3")
        run_dir = Path(tmp) / "run"
        config = load_config(None, small_run_overrides(
            ckpt, run_dir, f"controller.steps={args.steps}", "controller.checkpoint_every=2",
            f"controller.restart_trainer={args.kills}", "controller.log_samples=true", f"trainer.ranks={args.ranks}"))
        controller = TrainerKilledAsStepsBegin(config, kill_at=tuple(2 * (k + 1) for k in range(args.kills)))
        start, load = time.monotonic(), os.getloadavg()[0]
        history = asyncio.run(controller.run())
        wall_s = time.monotonic() - start
        once = recorded_once(run_dir, args.steps)
    kills = [at for _, at in controller.killed.values()]
    rebuilt = [after - kill for kill, after in zip(kills, controller.rebuilt_at)]
    stepped = [after - kill for kill, after in zip(kills, controller.stepped_at)]
    completed = len(history) == args.steps
    print(f"{len(rebuilt)} kills; kill to rebuilt {[round(s, 1) for s in rebuilt]} s, to a step again "
          f"{[round(s, 1) for s in stepped]} s; {len(history)}/{args.steps} steps in {wall_s:.0f} s; "
          f"every step recorded once: {once}")
    command = "python benchmarks/trainer_recovery.py" + "".join(
        f" --{k} {v}" for k, v in (("ranks", args.ranks), ("kills", args.kills), ("steps", args.steps))
        if v != parser.get_default(k))
    row = (f"| {machine('cpu')}, {datetime.date.today().isoformat()}, {commit()} | {load:.1f} | `{command}` | "
           f"{args.ranks} | "
           f"{args.steps} | {len(rebuilt)} | {', '.join(f'{s:.1f}' for s in rebuilt)} | "
           f"{', '.join(f'{s:.1f}' for s in stepped)} | {'yes' if completed else 'no'} | {'yes' if once else 'no'} |")
    text = args.out.read_text() if args.out.exists() else ""
    if SECTION not in text:
        text = text.rstrip("\n") + "\n\n" + "\n".join(HEADER) + "\n"
    args.out.write_text(text.rstrip("\n") + "\n" + row + "\n")
    print(f"appended to {args.out}")
    return 0 if completed and once and len(rebuilt) == args.kills else 1


if __name__ == "__main__":
    sys.exit(main())
