"""A run's learning curve as one row of a results table: every held-out eval, the training reward
in windows of steps, and the trainer-minus-generator mismatch (logprobs; experts), from its
metrics.jsonl, stamped with the machine, date, commit and command.

    python benchmarks/learning_curve.py runs/alphabet_sort_1gpu \\
        --command "python examples/alphabet_sort/run.py --config configs/alphabet_sort_1gpu.toml" \\
        --out benchmarks/results/alphabet_sort_1gpu_learning.md

--machine defaults to the GPUs this process sees (or the CPU). Without --out it prints the row's
figures. The run dir's reward_curve.png is the same curve, drawn.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from results_table import append_row, machine

from rlactors.run.metrics import EVAL_REWARD_MEAN, REWARD_MEAN, read_metrics

LOGPROB_DIFF_MAX, CURRENT_TOKENS = "loss/logprob_diff/max", "loss/current_policy_tokens"
EXPERT_MISMATCH, ROUTED_TOKENS = "loss/expert_mismatch/share", "loss/routed_tokens"
COLUMNS = ("run", "held-out eval reward (pass@1) at each eval step", "training reward per window of steps",
           "median s/step", f"`{LOGPROB_DIFF_MAX}`", f"`{EXPERT_MISMATCH}`")


def learning_curve(run_dir: Path, window: int) -> list[str]:
    """The row's figures (COLUMNS) of the run in `run_dir`; "-" where the run has none."""
    records = read_metrics(run_dir)
    steps = [r for r in records if REWARD_MEAN in r]
    evals = sorted((r for r in records if EVAL_REWARD_MEAN in r), key=lambda r: r["step"])
    evaluated = ", ".join(f"{r['step']}: {r[EVAL_REWARD_MEAN]:.3f} ({r['eval/pass@1']:.3f})" for r in evals)
    if evals:
        evaluated += f"; {evals[-1]['eval/samples']:.0f} samples"
    windows = [steps[i:i + window] for i in range(0, len(steps), window)]
    trained = ", ".join(f"{w[0]['step']}-{w[-1]['step']}: {statistics.fmean(r[REWARD_MEAN] for r in w):.3f}"
                        for w in windows)
    step_s = f"{statistics.median(r['time/step_s'] for r in steps):.2f}" if steps else "-"
    logprobs, experts = mismatch(steps)
    return [run_dir.name, evaluated or "-", trained or "-", step_s, logprobs, experts]


def mismatch(steps: list[dict]) -> tuple[str, str]:
    """The trainer-minus-generator logprob difference over the steps, and of a mixture of experts
    the share of tokens routed to other experts (over the tokens whose experts the generator returned)."""
    logprobs = experts = "-"
    # The difference covers the tokens of the trainer's current policy: in async mode some steps have none.
    measured = [r for r in steps if r.get(CURRENT_TOKENS)]
    if measured:
        diffs = [r[LOGPROB_DIFF_MAX] for r in measured]
        logprobs = (f"max {max(diffs):.3g} over {len(measured)} of {len(steps)} steps "
                    f"({sum(r[CURRENT_TOKENS] for r in measured):.0f} tokens), above 0 at {sum(d > 0 for d in diffs)}")
    routed = [r for r in steps if r.get(ROUTED_TOKENS)]
    if routed:
        share = sum(r[EXPERT_MISMATCH] * r[ROUTED_TOKENS] for r in routed) / sum(r[ROUTED_TOKENS] for r in routed)
        experts = (f"{share:.3g} of {sum(r[ROUTED_TOKENS] for r in routed):.0f} tokens over {len(routed)} steps, "
                   f"max {max(r[EXPERT_MISMATCH] for r in routed):.3g}")
    elif any(ROUTED_TOKENS in r for r in steps):
        experts = "not measured (no experts from the generator)"
    return logprobs, experts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--machine", default=None, help="default: the GPUs this process sees, else the CPU")
    parser.add_argument("--command", required=True)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    figures = learning_curve(args.run_dir, args.window)
    if args.out is None:
        print(" | ".join(figures))
        return
    if args.machine is None:
        import torch

        args.machine = machine("cuda" if torch.cuda.is_available() else "cpu")
    row = append_row(args.out, f"Learning curves: {args.out.stem}", COLUMNS, figures, machine_name=args.machine,
                     command_line=args.command)
    print(f"appended to {args.out}: {row}")


if __name__ == "__main__":
    main()
