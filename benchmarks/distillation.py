"""On-policy distillation against GRPO alone on alphabet_sort: the student's held-out eval reward
per step trained by GRPO, and by GRPO plus a teacher's per-token reverse KL (`teacher.path`, the
teacher mesh), with the teacher's own eval level; one plot, and a row appended to
benchmarks/results/distillation_cpu.md (results_table.py).

    python benchmarks/distillation.py --steps 20 --eval-every 5 --eval-samples 100 \
        rollout.prompts_per_step=1 rollout.keep_zero_variance_groups=true env.args.similarity_power=16

That is the setting where GRPO is slow: one prompt of 4 rollouts a step and a sparse reward (a
turn scores its sort's similarity to the 16th power, not the 4th), so most groups carry no reward
signal while the teacher's signal is on every token; zero-variance groups are kept for both runs.
With the config's 16 prompts a step GRPO alone reaches the teacher within 10 steps.
Defaults: the student is examples/alphabet_sort/warm_checkpoint_gpu (its demonstrations forgot
the answer tags in 70% of turns: its greedy replies score low), the teacher
examples/alphabet_sort/warm_checkpoint (same shape and tokenizer, 40% untagged: clearly higher),
on configs/alphabet_sort_cpu.toml. A stronger teacher is a run's own checkpoint: a GRPO run of
this benchmark trained further (`--teacher RUN/checkpoints/step_N/hf`), whose curve `--grpo-run RUN`
then reuses instead of training GRPO again (same config and seed). "Steps to close 80%": the
first eval step at which the student has closed 80% of its step-0 gap to the teacher. Overrides
after the options apply to every run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from results_table import RESULTS, ROOT, append_row

from rlactors.run.metrics import EVAL_REWARD_MEAN, read_metrics

COLUMNS = ("student", "teacher", "teacher eval", "steps", "GRPO eval by step", "distilled eval by step",
           "GRPO steps to close 80%", "distilled steps to close 80%", "plot")
EXAMPLES = ROOT / "examples" / "alphabet_sort"


def evaluate(checkpoint: Path, config: Path, overrides: list[str], out: Path) -> float:
    subprocess.run([sys.executable, "-m", "rlactors.evaluate", str(checkpoint), "--config", str(config),
                    "--out", str(out), "--no-progress", *overrides], check=True, cwd=ROOT)
    return json.loads(out.read_text())[EVAL_REWARD_MEAN]


def train(run_dir: Path, config: Path, overrides: list[str]) -> dict[int, float]:
    """The run's held-out eval reward by step."""
    subprocess.run([sys.executable, "-m", "rlactors.train", "--config", str(config),
                    f"controller.run_dir={json.dumps(str(run_dir))}", *overrides], check=True, cwd=ROOT)
    return eval_curve(run_dir)


def eval_curve(run_dir: Path) -> dict[int, float]:
    return {int(r["step"]): r[EVAL_REWARD_MEAN] for r in read_metrics(run_dir) if EVAL_REWARD_MEAN in r}


def steps_to_close(curve: dict[int, float], teacher: float, share: float) -> str:
    start = curve[min(curve)]
    target = start + share * (teacher - start)
    return next((str(step) for step, value in sorted(curve.items()) if value >= target), "not reached")


def label(path: Path) -> str:
    """A checkpoint's name: its dir, or for a run's `hf/` export the run and step it comes from."""
    path = path.resolve()
    return "/".join(path.parts[-4:]) if path.name == "hf" else path.name


def plot(curves: dict[str, dict[int, float]], teacher: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, curve in curves.items():
        steps = sorted(curve)
        ax.plot(steps, [curve[s] for s in steps], marker="o", label=label)
    ax.axhline(teacher, color="gray", linestyle="--", label="teacher")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out eval reward (greedy)")
    ax.set_title("alphabet_sort: on-policy distillation vs GRPO alone")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "alphabet_sort_cpu.toml")
    parser.add_argument("--student", type=Path, default=EXAMPLES / "warm_checkpoint_gpu")
    parser.add_argument("--teacher", type=Path, default=EXAMPLES / "warm_checkpoint")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--eval-samples", type=int, default=200)
    parser.add_argument("--coef", type=float, default=1.0, help="teacher.coef")
    parser.add_argument("--grpo-run", type=Path, help="a finished GRPO run dir of the same settings, to reuse")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    common = [f"model.path={json.dumps(str(args.student))}", f"controller.steps={args.steps}",
              f"controller.eval_every={args.eval_every}", f"eval.samples={args.eval_samples}",
              "controller.checkpoint_every=0", *args.overrides]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        teacher = evaluate(args.teacher, args.config, [f"eval.samples={args.eval_samples}", *args.overrides],
                           tmp / "teacher.json")
        curves = {"GRPO": eval_curve(args.grpo_run) if args.grpo_run else train(tmp / "grpo", args.config, common),
                  "GRPO + distillation": train(tmp / "distilled", args.config,
                                               [*common, f"teacher.path={json.dumps(str(args.teacher))}",
                                                f"teacher.coef={args.coef}"])}
    png = RESULTS / "distillation_cpu.png"
    plot(curves, teacher, png)

    def by_step(curve: dict[int, float]) -> str:
        return ", ".join(f"{step}: {value:.3f}" for step, value in sorted(curve.items()))

    figures = [label(args.student), label(args.teacher), f"{teacher:.3f}", args.steps, by_step(curves["GRPO"]),
               by_step(curves["GRPO + distillation"]),
               *(steps_to_close(curve, teacher, 0.8) for curve in curves.values()), png.name]
    print(append_row(RESULTS / "distillation_cpu.md", "On-policy distillation against GRPO alone (alphabet_sort)",
                     COLUMNS, figures, device="cpu"))


if __name__ == "__main__":
    main()
