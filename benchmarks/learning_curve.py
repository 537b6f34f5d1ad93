"""A run's learning curve as Markdown: every held-out eval, the training reward in windows of steps,
and the trainer-minus-generator mismatch (logprobs; experts), from its metrics.jsonl; appended to
a results file with the machine, date, commit and command.

    python benchmarks/learning_curve.py runs/alphabet_sort_1gpu \\
        --command "python examples/alphabet_sort/run.py --config configs/alphabet_sort_1gpu.toml" \\
        --out benchmarks/results/alphabet_sort_1gpu_learning.md

--machine defaults to the GPUs this process sees (or the CPU). Without --out it prints the section.
The run dir's reward_curve.png is the same curve, drawn.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
from pathlib import Path

from results_table import commit, machine

from rlactors.run.metrics import EVAL_REWARD_MEAN, REWARD_MEAN, read_metrics

LOGPROB_DIFF_MAX, CURRENT_TOKENS = "loss/logprob_diff/max", "loss/current_policy_tokens"
EXPERT_MISMATCH, ROUTED_TOKENS = "loss/expert_mismatch/share", "loss/routed_tokens"


def learning_curve(run_dir: Path, machine: str, command: str, window: int) -> str:
    records = read_metrics(run_dir)
    steps = [r for r in records if REWARD_MEAN in r]
    evals = sorted((r for r in records if EVAL_REWARD_MEAN in r), key=lambda r: r["step"])
    lines = [f"## {run_dir.name}, {datetime.date.today().isoformat()}", "",
             f"Machine: {machine}. Commit: {commit()}. Command: `{command}`.", ""]
    if evals:
        first, last = evals[0], evals[-1]
        best = max(evals, key=lambda r: r[EVAL_REWARD_MEAN])
        gain = last[EVAL_REWARD_MEAN] - first[EVAL_REWARD_MEAN]
        lines += [f"Held-out eval reward {first[EVAL_REWARD_MEAN]:.3f} at step {first['step']} -> "
                  f"{last[EVAL_REWARD_MEAN]:.3f} at step {last['step']} ({gain:+.3f}; "
                  f"best {best[EVAL_REWARD_MEAN]:.3f} at step {best['step']}), {last['eval/samples']:.0f} samples, "
                  f"{last['eval/rollouts'] / last['eval/samples']:.0f} rollout(s) each.", "",
                  "| step | eval reward | pass@1 | policy version | eval s | wall s since step 1 |",
                  "|---|---|---|---|---|---|"]
        start = next((r["time"] - r.get("time/step_s", 0.0) for r in steps), evals[0]["time"])
        for r in evals:
            versions = f"{r['eval/policy_version']:.0f}"
            if r["eval/policy_version_max"] != r["eval/policy_version"]:
                versions += f"-{r['eval/policy_version_max']:.0f}"
            lines.append(f"| {r['step']} | {r[EVAL_REWARD_MEAN]:.3f} | {r['eval/pass@1']:.3f} | {versions} | "
                         f"{r['eval/time_s']:.1f} | {max(0.0, r['time'] - start):.0f} |")
        lines.append("")
    if steps:
        step_s = statistics.median(r["time/step_s"] for r in steps)
        lines += [f"Training reward (sampled), mean over windows of {window} steps; median {step_s:.2f} s/step:", "",
                  "| steps | reward |", "|---|---|"]
        for i in range(0, len(steps), window):
            chunk = steps[i:i + window]
            mean = statistics.fmean(r[REWARD_MEAN] for r in chunk)
            lines.append(f"| {chunk[0]['step']}-{chunk[-1]['step']} | {mean:.3f} |")
        lines += ["", *mismatch_lines(steps)]
    return "\n".join(lines) + "\n"


def mismatch_lines(steps: list[dict]) -> list[str]:
    """The trainer-minus-generator logprob difference over the steps, and of a mixture of experts
    the share of tokens routed to other experts (over the tokens whose experts the generator returned)."""
    lines = []
    # The difference covers the tokens of the trainer's current policy: in async mode some steps have none.
    measured = [r for r in steps if r.get(CURRENT_TOKENS)]
    if measured:
        diffs = [r[LOGPROB_DIFF_MAX] for r in measured]
        lines.append(f"`{LOGPROB_DIFF_MAX}`: max {max(diffs):.3g} over the {len(measured)} of {len(steps)} steps with "
                     f"tokens of the trainer's current policy ({sum(r[CURRENT_TOKENS] for r in measured):.0f} "
                     f"tokens), above 0 at {sum(d > 0 for d in diffs)}.")
    routed = [r for r in steps if r.get(ROUTED_TOKENS)]
    if any(ROUTED_TOKENS in r for r in steps):
        if routed:
            share = sum(r[EXPERT_MISMATCH] * r[ROUTED_TOKENS] for r in routed) / sum(r[ROUTED_TOKENS] for r in routed)
            lines.append(f"`{EXPERT_MISMATCH}`: {share:.3g} of {sum(r[ROUTED_TOKENS] for r in routed):.0f} tokens "
                         f"over {len(routed)} steps; max {max(r[EXPERT_MISMATCH] for r in routed):.3g} in a step.")
        else:
            lines.append(f"`{EXPERT_MISMATCH}`: not measured (`{ROUTED_TOKENS}` 0 at every step: no experts "
                         "from the generator for tokens of the trainer's current policy).")
    return [*lines, ""] if lines else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--machine", default=None, help="default: the GPUs this process sees, else the CPU")
    parser.add_argument("--command", required=True)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.machine is None:
        import torch

        args.machine = machine("cuda" if torch.cuda.is_available() else "cpu")
    section = learning_curve(args.run_dir, args.machine, args.command, args.window)
    if args.out is None:
        print(section, end="")
        return
    separator = "\n" if args.out.exists() and args.out.stat().st_size else ""
    with args.out.open("a") as f:
        f.write(separator + section)
    print(f"appended to {args.out}")


if __name__ == "__main__":
    main()
