"""Per-step metrics: one record per step to the console, metrics.jsonl, TensorBoard and a PNG.

Records are flat `{"group/name": float}` dicts. The reward curve is drawn from metrics.jsonl, so it can be redrawn
for any run dir with `python -m rlactors.metrics RUN_DIR`.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

REWARD_MEAN, REWARD_MIN, REWARD_MAX = "rollout/reward_mean", "rollout/reward_min", "rollout/reward_max"

CONSOLE_KEYS = (
    (REWARD_MEAN, "reward {:.3f}"),
    ("loss/loss", "loss {:+.4f}"),
    ("train/grad_norm", "gnorm {:.3f}"),
    ("policy/age_mean", "age {:.2f}"),
    ("time/step_s", "{:.1f}s/step"),
    ("throughput/generated_tokens_per_s", "gen {:.0f} tok/s"),
)


class MetricsLogger:
    """Writes step records under `run_dir`; `resume_step` drops records of steps after it."""

    def __init__(self, run_dir: str | Path, total_steps: int, resume_step: int = 0, tensorboard: bool = True):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.total_steps = total_steps
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.samples_path = self.run_dir / "samples.jsonl"
        for path in (self.metrics_path, self.samples_path):
            _truncate_after(path, resume_step)
        self._writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=resume_step + 1)
        self._start = time.monotonic()
        self._first_step = resume_step + 1

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, "time": time.time(), **{k: _plain(v) for k, v in metrics.items()}}
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._writer is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._writer.add_scalar(key, value, step)
            self._writer.flush()
        print(self.console_line(step, metrics), file=sys.stdout, flush=True)

    def console_line(self, step: int, metrics: dict[str, float]) -> str:
        done = step - self._first_step + 1
        elapsed = time.monotonic() - self._start
        eta = elapsed / max(done, 1) * (self.total_steps - step)
        width = 20
        filled = round(width * step / max(self.total_steps, 1))
        parts = [f"step {step:>4}/{self.total_steps} [{'#' * filled}{'.' * (width - filled)}]"]
        parts += [fmt.format(metrics[key]) for key, fmt in CONSOLE_KEYS if key in metrics]
        parts.append(f"eta {eta:.0f}s")
        return "  ".join(parts)

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        with self.samples_path.open("a") as f:
            for sample in samples:
                f.write(json.dumps({"step": step, **sample}) + "\n")

    def close(self) -> Path | None:
        if self._writer is not None:
            self._writer.close()
        return plot_reward_curve(self.run_dir)


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


def _truncate_after(path: Path, step: int) -> None:
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in kept))


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def plot_reward_curve(run_dir: str | Path, title: str | None = None) -> Path | None:
    """reward_curve.png: mean reward per step, its trailing 5-step mean, and the min-max band over
    rollouts; None when no step has a reward."""
    records = [r for r in read_metrics(run_dir) if isinstance(r.get(REWARD_MEAN), (int, float))]
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(7, 4))
    if all(REWARD_MIN in r and REWARD_MAX in r for r in records):
        ax.fill_between(steps, [r[REWARD_MIN] for r in records], [r[REWARD_MAX] for r in records],
                        alpha=0.12, label="min-max over rollouts")
    means = [r[REWARD_MEAN] for r in records]
    ax.plot(steps, means, marker="o", markersize=3, linewidth=1, alpha=0.6, label="mean reward")
    # Step means are noisy (a few prompts each); the trailing mean shows the trend.
    trailing = [sum(means[max(0, i - 4):i + 1]) / len(means[max(0, i - 4):i + 1]) for i in range(len(means))]
    ax.plot(steps, trailing, linewidth=2.5, label="trailing 5-step mean")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_title(title or f"reward: {Path(run_dir).name}")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    out = Path(run_dir) / "reward_curve.png"
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


if __name__ == "__main__":
    print(plot_reward_curve(sys.argv[1]))
