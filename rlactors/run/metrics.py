"""Per-step metrics: one record per step to the console, metrics.jsonl, TensorBoard, optionally
Weights & Biases, and a PNG; one record per evaluation (`eval/*`) to the same sinks; env errors to
env_errors.log (and the first of each kind to the console).

Records are flat `{"group/name": float}` dicts with their step. An evaluation's record carries the
step of the policy it scored, and in async mode arrives after later steps' records. The reward
curve is drawn from metrics.jsonl, so it can be redrawn for any run dir with
`python -m rlactors.run.metrics RUN_DIR`.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlactors.run.run_dir import (
    ENV_ERRORS_FILE,
    METRICS_FILE,
    REWARD_CURVE_FILE,
    SAMPLES_FILE,
    STEP_RECORD_KEY,
    TENSORBOARD_DIR,
    WANDB_RUN_ID_FILE,
)
from rlactors.storage.records import keep_records_through, read_records, writing

if TYPE_CHECKING:
    from rlactors.rollout.types import Episode, Rollout, RolloutGroup
    from rlactors.run.turns import StepUpdate

REWARD_MEAN, REWARD_MIN, REWARD_MAX = STEP_RECORD_KEY, "rollout/reward_min", "rollout/reward_max"
REWARD_P25, REWARD_P75 = "rollout/reward_p25", "rollout/reward_p75"
EVAL_REWARD_MEAN = "eval/reward_mean"

CONSOLE_KEYS = (
    (REWARD_MEAN, "reward {:.3f}"),
    ("loss/loss", "loss {:+.4f}"),
    ("train/grad_norm", "gnorm {:.3f}"),
    ("policy/age_mean", "age {:.2f}"),
    ("time/step_s", "{:.1f}s/step"),
    ("throughput/generated_tokens_per_s", "gen {:.0f} tok/s"),
)
# The statuses of a rollout that the env ended: it raised, hung or returned something unusable.
ENV_ERROR_STATUSES = ("error_env", "error_timeout", "error_parse")
# What to try when steps train nothing because every group's rewards are equal.
NO_SIGNAL_HINT = ("start from a policy that sometimes succeeds (a warm start in model.path), make the task easier "
                  "or its reward partial, or raise rollout.group_size or rollout.temperature")


class MetricsLogger:
    """Writes step and eval records under `run_dir` (and to `wandb`, a WandbSink, when given);
    `resume_step` drops records of steps after it (a run rebuilt before its first checkpoint keeps
    the evaluation of step 0)."""

    def __init__(self, run_dir: str | Path, total_steps: int, resume_step: int = 0, tensorboard: bool = True,
                 wandb: WandbSink | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.total_steps = total_steps
        self.metrics_path = self.run_dir / METRICS_FILE
        self.samples_path = self.run_dir / SAMPLES_FILE
        for path in (self.metrics_path, self.samples_path):
            keep_records_through(path, resume_step)
        self._writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.run_dir / TENSORBOARD_DIR), purge_step=resume_step + 1)
        self._wandb = wandb
        self._start = time.monotonic()
        self._first_step = resume_step + 1
        self._told_no_signal = False

    def log(self, step: int, metrics: dict[str, float], note: str | None = None) -> None:
        """One step's record; `note` ends its console line (e.g. why the step trained nothing)."""
        self._write(step, metrics)
        print(self.console_line(step, metrics, note), file=sys.stdout, flush=True)

    def log_step(self, step: int, metrics: dict[str, float], groups: Sequence[RolloutGroup],
                 untrained: str | None) -> None:
        """A step's record; a step that trained nothing says why (`untrained`) on its line, and the
        first one whose groups all earned equal rewards says what to try."""
        self.log(step, metrics, note=untrained and f"trained nothing: {untrained}")
        if untrained and all(g.dropped for g in groups) and not self._told_no_signal \
                and every_rollout_failed(groups) is None:
            self._told_no_signal = True
            print(no_signal_line(step), flush=True)

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        """One evaluation's `eval/*` record, at the step of the policy it scored."""
        self._write(step, metrics)
        print(eval_line(step, metrics), file=sys.stdout, flush=True)

    def _write(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, "time": time.time(), **{k: _plain(v) for k, v in metrics.items()}}
        with writing(self.metrics_path), self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        scalars = {key: float(value) for key, value in record.items() if key not in ("step", "time")
                   and isinstance(value, (int, float)) and math.isfinite(value)}
        if self._writer is not None:
            for key, value in scalars.items():
                self._writer.add_scalar(key, value, step)
            self._writer.flush()
        if self._wandb is not None:
            self._wandb.log(step, scalars)

    def console_line(self, step: int, metrics: dict[str, float], note: str | None = None) -> str:
        done = step - self._first_step + 1
        elapsed = time.monotonic() - self._start
        eta = elapsed / max(done, 1) * (self.total_steps - step)
        width = 20
        filled = round(width * step / max(self.total_steps, 1))
        parts = [f"step {step:>4}/{self.total_steps} [{'#' * filled}{'.' * (width - filled)}]"]
        parts += [fmt.format(metrics[key]) for key, fmt in CONSOLE_KEYS if key in metrics]
        env_errors = sum(metrics.get(f"rollout/status/{status}", 0.0) for status in ENV_ERROR_STATUSES)
        if env_errors:
            parts.insert(2, f"env errors {env_errors:.0f}/{metrics.get('rollout/rollouts', 0.0):.0f}")
        if note:
            parts.append(note)
        parts.append(f"eta {eta:.0f}s")
        return "  ".join(parts)

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """A step's samples: written before its metrics record, which marks the step as recorded."""
        with writing(self.samples_path), self.samples_path.open("a") as f:
            f.writelines(json.dumps({"step": step, **sample}) + "\n" for sample in samples)

    def close(self, failing: bool = False) -> Path | None:
        """Closes the sinks and draws reward_curve.png. When the run is `failing` already, an
        error here is dropped: the first error is the one the run stops with."""
        try:
            if self._writer is not None:
                self._writer.close()
            if self._wandb is not None:
                self._wandb.finish()
            return plot_reward_curve(self.run_dir)
        except Exception:  # noqa: BLE001 - re-raised unless another error already stops the run
            if failing:
                return None
            raise


def eval_line(step: int, metrics: dict[str, float]) -> str:
    """The console line of an evaluation: rewards, pass rates, errors, size, policy, time."""
    rollouts = metrics.get("eval/rollouts", 0.0)
    parts = [f"eval of step {step}: reward {metrics[EVAL_REWARD_MEAN]:.3f}"]
    parts += [f"{key[5:]} {metrics[key]:.3f}"
              for key in sorted(metrics) if key.startswith(("eval/pass@", "eval/best@"))]
    errors = sum(value for key, value in metrics.items() if key.startswith("eval/status/error_"))
    if errors:
        parts.append(f"errors {errors:.0f}/{rollouts:.0f}")
    samples = metrics.get("eval/samples", 0.0)
    per_prompt = f" x {rollouts / samples:.0f}" if samples and rollouts != samples else ""
    # Async mode: the generators may take newer policies while an eval runs (a range, oldest first).
    version = metrics.get("eval/policy_version", 0.0)
    newest = max(version, metrics.get("eval/policy_version_max", version))
    versions = f"version {version:.0f}" if newest == version else f"versions {version:.0f} to {newest:.0f}"
    parts.append(f"{samples:.0f} held-out samples{per_prompt}, {metrics.get('eval/generated_tokens_mean', 0.0):.0f} "
                 f"tokens each, policy {versions}, {metrics.get('eval/time_s', 0.0):.1f}s")
    return "  ".join(parts)


def check_wandb() -> None:
    """Raises ConfigError unless the wandb package can be imported (before anything is spawned)."""
    from rlactors.config import ConfigError

    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ConfigError('metrics.wandb_project: logging to W&B needs the wandb package: '
                          'pip install -e ".[wandb]"') from None


class WandbSink:
    """A Weights & Biases run that gets the records TensorBoard gets, against their step.

    Records are logged with their step as the metric `step` (every other metric is plotted against
    it) rather than as W&B's own step, which must only grow: an evaluation's record arrives after
    later steps' records in async mode. `WANDB_MODE=offline` writes the run under run_dir/wandb for
    `wandb sync`, with no network. A resumed run logs into the W&B run it started."""

    @classmethod
    def for_run(cls, run_dir: str | Path, config: Any, resume: bool) -> WandbSink:
        """The sink of a run with `config` (metrics.wandb_project set)."""
        return cls(run_dir, config.metrics.wandb_project, config.metrics.wandb_run, config.to_dict(), resume)

    def __init__(self, run_dir: str | Path, project: str, name: str, config: dict[str, Any], resume: bool):
        import wandb

        id_file = Path(run_dir) / WANDB_RUN_ID_FILE
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else None
        self.run = wandb.init(project=project, name=name or Path(run_dir).name, dir=str(run_dir), config=config,
                              id=run_id, resume="allow" if run_id else None)
        id_file.write_text(self.run.id)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log({"step": step, **scalars})

    def finish(self) -> None:
        self.run.finish()


class EnvErrorLog:
    """Every env error of a run, with its traceback where the env raised, in run_dir/env_errors.log
    (appended to on a resume). The first error of each kind (its status, exception type and the
    line that raised it) is also printed, up to `console_kinds` kinds, so a broken env shows at
    once without flooding the console."""

    def __init__(self, run_dir: str | Path, resume_step: int = 0, console_kinds: int = 3):
        self.path = Path(run_dir) / ENV_ERRORS_FILE
        self.console_kinds = console_kinds
        self._kinds: set[tuple[str, ...]] = set()
        self._told_more = False
        with writing(self.path):
            if resume_step:
                with self.path.open("a") as f:
                    f.write(f"--- resumed after step {resume_step} ---\n")
            else:
                self.path.write_text("")

    def record(self, step: int, rollouts: Iterable[Rollout]) -> int:
        """Logs the env errors among `rollouts` (trained in `step`); returns how many there were."""
        errors = [r for r in rollouts if r.status.value in ENV_ERROR_STATUSES]
        if not errors:
            return 0
        with writing(self.path), self.path.open("a") as f:
            for rollout in errors:
                traceback = f"{rollout.error_traceback}\n" if rollout.error_traceback else ""
                f.write(f"{self._describe(step, rollout)}\nsample: {_short(repr(rollout.sample), 500)}\n{traceback}\n")
        for rollout in errors:
            kind = _error_kind(rollout)
            if kind in self._kinds:
                continue
            self._kinds.add(kind)
            if len(self._kinds) <= self.console_kinds:
                text = self._describe(step, rollout)
                if rollout.error_traceback:
                    text += "\n" + rollout.error_traceback
                if len(self._kinds) == 1:
                    text += (f"\n(the first error of each kind is printed, of {self.console_kinds} kinds at most; "
                             f"every env error is in {self.path})")
                print(text, file=sys.stdout, flush=True)
            elif not self._told_more:
                self._told_more = True
                print(f"env errors of more kinds in step {step}: see {self.path}", file=sys.stdout, flush=True)
        return len(errors)

    @staticmethod
    def _describe(step: int, rollout: Rollout) -> str:
        return f"env error in step {step}, rollout {rollout.session_id} ({rollout.status.value}): {rollout.error}"


def optimizer_metrics(optim: dict[str, float]) -> dict[str, float]:
    """The trainer's step results under their names: `train/` for the update, `loss/` for the rest."""
    train_keys = ("grad_norm", "lr", "update_skipped")
    return {(f"train/{k}" if k in train_keys else f"loss/{k}"): float(v) for k, v in optim.items()}


def step_metrics(groups: Sequence[RolloutGroup], update: StepUpdate, *, trained: bool, policy_version: int,
                 ages: Sequence[int], stale: int, step_s: float, rollout_wait_s: float) -> dict[str, float]:
    """A step's record: its rollouts (`summarize` of its groups), its update (`take_turns`'), the
    age of its episodes, where its time went and its throughput."""
    from rlactors.rollout.rollouter import summarize

    train_metrics, train_s = update.trained, update.seconds["train"]
    generated = sum(r.num_generated_tokens for g in groups for r in g.rollouts)
    metrics = {
        **summarize(groups),
        **train_metrics,
        "train/trained": float(trained),
        "policy/version": float(policy_version),
        "policy/age_mean": sum(ages) / len(ages) if ages else 0.0,
        "policy/age_max": float(max(ages, default=0)),
        "policy/stale_episodes_dropped": float(stale),
        "time/step_s": step_s,
        "time/rollout_wait_s": rollout_wait_s,
        "time/train_s": train_s,
        "time/weight_sync_s": update.seconds["sync"],
        **{f"weight_sync/{k}": v for k, v in update.synced.items()},
        "time/checkpoint_s": update.seconds["checkpoint"],
        "time/trainer_idle_fraction": rollout_wait_s / step_s if step_s else 0.0,
        "throughput/generated_tokens_per_s": generated / step_s if step_s else 0.0,
        **update.turns,
    }
    if "batcher/tokens" in train_metrics and train_s:
        metrics["throughput/trained_tokens_per_s"] = train_metrics["batcher/tokens"] / train_s
    return metrics


def untrained_reason(groups: Sequence[RolloutGroup], episodes: Sequence[Episode], stale: int,
                     max_staleness: int) -> str:
    """Why a step took no optimizer step, for its console line."""
    if (error := every_rollout_failed(groups)) is not None:
        return f"every rollout ended in an error, e.g. {error}"
    if all(g.dropped for g in groups):
        return f"equal rewards in each of its {len(groups)} groups"
    if stale and not episodes:
        return f"its {stale} episodes were all older than controller.max_staleness={max_staleness} versions"
    return "its rollouts generated no token to train on"


def every_rollout_failed(groups: Sequence[RolloutGroup]) -> str | None:
    """When every rollout of a step ended in an error (`error_*`), the most frequent one, as
    `status: error (n of N rollouts)`; None otherwise."""
    rollouts = [r for g in groups for r in g.rollouts]
    if not rollouts or not all(r.status.is_error for r in rollouts):
        return None
    errors = Counter((r.status.value, " ".join((r.error or "no message").split())) for r in rollouts)
    (status, error), n = errors.most_common(1)[0]
    return f"{status}: {_short(error, 400)} ({n} of {len(rollouts)} rollouts)"


def failed_steps_line(first: int, last: int, error: str, limit: int) -> str:
    """Why a run stops after `limit` steps in a row in which every rollout failed."""
    steps = f"step {last}" if first == last else f"steps {first}-{last}"
    return (f"{steps}: every rollout ended in an error, so nothing was trained ({last - first + 1} such steps in a "
            f"row, controller.max_errored_steps={limit}); the last step's: {error}")


class ErroredSteps:
    """Counts the steps in a row in which every rollout ended in an error, against `limit`
    (controller.max_errored_steps; 0: never stop)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_a_row = 0

    def stop_line(self, step: int, groups: Sequence[RolloutGroup]) -> str | None:
        """Counts `step`; the line that stops the run once `limit` such steps came in a row, else None."""
        error = every_rollout_failed(groups)
        self.in_a_row = self.in_a_row + 1 if error else 0
        if error is None or self.in_a_row != self.limit:
            return None
        return failed_steps_line(step - self.in_a_row + 1, step, error, self.limit)


def no_signal_line(step: int) -> str:
    """Said once, at the first step whose groups all earned equal rewards."""
    return (f"step {step} trained nothing: the rollouts of each group earned equal rewards, so GRPO has "
            f"nothing to learn from. The run goes on (later samples may differ); if no step trains, "
            f"{NO_SIGNAL_HINT}")


def reward_trend(steps: Sequence[dict[str, Any]], window: int = 10) -> str:
    """The run's reward as means over its first and last `window` steps (fewer: a quarter of the
    run, at least one), so one noisy step does not speak for the run:
    `reward 0.286 over steps 1-10 -> 0.471 over steps 71-80`."""
    def mean_over(records: Sequence[dict[str, Any]]) -> str:
        first, last = records[0]["step"], records[-1]["step"]
        span = f"step {first}" if first == last else f"steps {first}-{last}"
        return f"{sum(r[REWARD_MEAN] for r in records) / len(records):.3f} over {span}"

    k = max(1, min(window, len(steps) // 4))
    if len(steps) == 1:
        return f"reward {mean_over(steps)}"
    return f"reward {mean_over(steps[:k])} -> {mean_over(steps[-k:])}"


class GeneratorMetrics:
    """`generator/*` metrics of a step from the router's stats, and the generators' idle share:
    the share of replica time since the previous reading spent outside engine steps (not
    generating). A restarted replica's counter starts again at 0, so a step that saw a restart
    reports no idle share."""

    def __init__(self) -> None:
        self._busy: tuple[float, float] | None = None  # (time, busy seconds of all replicas)

    def read(self, stats: dict[str, Any]) -> dict[str, float]:
        serving = stats["states"]["serving"]
        metrics = {"generator/serving_replicas": float(serving),
                   "generator/dead_replicas": float(stats["states"]["dead"]),
                   "generator/retries": float(stats["retries"]), "generator/restarts": float(stats["restarts"]),
                   "generator/weight_groups": float(stats["weight_groups"])}
        engines = [r["engine"] for r in stats["replicas"] if r["engine"] is not None]
        # Versions a replica accepted but never loaded, because a newer one arrived first.
        metrics["generator/superseded_updates"] = float(sum(e["superseded"] for e in engines))
        now = time.perf_counter()
        busy = sum(e["busy_s"] for e in engines)
        if self._busy is not None and serving:
            then, busy_then = self._busy
            if busy >= busy_then:
                idle = 1.0 - (busy - busy_then) / ((now - then) * serving)
                metrics["time/generator_idle_fraction"] = min(max(idle, 0.0), 1.0)
        self._busy = (now, busy)
        return metrics


def sample_records(groups: Sequence[RolloutGroup], tokenizer: Any) -> list[dict[str, Any]]:
    """samples.jsonl's records of a step: the best and the worst rollout of each group and every
    one that ended in an error, decoded: each turn's prompt (the first whole, later ones what the
    env added) and completion, and the error's message."""
    out = []
    for group in groups:
        ranked = sorted(group.rollouts, key=lambda r: r.reward)
        chosen = {id(ranked[0]): "worst", id(ranked[-1]): "best"}
        chosen.update({id(r): "error" for r in group.rollouts if r.status.is_error and id(r) not in chosen})
        for rollout in group.rollouts:
            if id(rollout) in chosen:
                out.append({"group": group.group_id, "rollout": rollout.index, "which": chosen[id(rollout)],
                            "reward": rollout.reward, "status": rollout.status.value, "error": rollout.error,
                            "turns": _decoded_turns(rollout, tokenizer)})
    return out


def _decoded_turns(rollout: Rollout, tokenizer: Any) -> list[dict[str, str]]:
    if not rollout.turns and rollout.prompt_token_ids:  # a prompt that left no room to generate
        return [{"prompt": tokenizer.decode(rollout.prompt_token_ids), "completion": ""}]
    turns, context = [], []
    for turn in rollout.turns:
        prompt = turn.prompt_token_ids
        added = prompt[len(context):] if prompt[:len(context)] == context else prompt  # a rewrite: all of it
        turns.append({"prompt": tokenizer.decode(added), "completion": tokenizer.decode(turn.token_ids)})
        context = prompt + turn.token_ids
    return turns


def _error_kind(rollout: Rollout) -> tuple[str, ...]:
    if not rollout.error_traceback:
        return (rollout.status.value, rollout.error or "")
    lines = rollout.error_traceback.splitlines()
    frames = [line for line in lines if line.startswith('  File "')]
    return (rollout.status.value, frames[-1] if frames else "", lines[-1].split(":", 1)[0])


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of metrics.jsonl; a torn line (a crash mid-write) is dropped, and said."""
    return read_records(Path(run_dir) / METRICS_FILE)


def plot_reward_curve(run_dir: str | Path, title: str | None = None) -> Path | None:
    """reward_curve.png (`reward_curve_figure` of the run's metrics.jsonl); None when no step has a
    reward and no evaluation ran."""
    records = read_metrics(run_dir)
    fig = reward_curve_figure(records, title or f"reward: {Path(run_dir).name}")
    if fig is None:
        return None
    import matplotlib.pyplot as plt

    out = Path(run_dir) / REWARD_CURVE_FILE
    tmp = out.with_name(f".{out.name}.tmp")  # never a cut PNG in its place
    try:
        with writing(tmp):
            fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
        os.replace(tmp, out)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return out


def reward_curve_figure(records: list[dict[str, Any]], title: str) -> Any:
    """A matplotlib Figure: mean reward per step, its trailing 5-step mean, and the band of the
    middle half of the rollouts' rewards (25th to 75th percentile); beside them the held-out eval
    reward of each evaluation; the legend right of the axes, off the data. None when there is
    nothing to draw."""
    steps_with_reward = [r for r in records if isinstance(r.get(REWARD_MEAN), (int, float))]
    evals = sorted((r["step"], r[EVAL_REWARD_MEAN])
                   for r in records if isinstance(r.get(EVAL_REWARD_MEAN), (int, float)))
    if not steps_with_reward and not evals:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    if steps_with_reward:
        steps = [r["step"] for r in steps_with_reward]
        if all(REWARD_P25 in r and REWARD_P75 in r for r in steps_with_reward):  # older runs have no quartiles
            ax.fill_between(steps, [r[REWARD_P25] for r in steps_with_reward],
                            [r[REWARD_P75] for r in steps_with_reward], alpha=0.2, linewidth=0,
                            label="middle half of rollouts\n(25th-75th percentile)")
        means = [r[REWARD_MEAN] for r in steps_with_reward]
        ax.plot(steps, means, marker="o", markersize=3, linewidth=1, alpha=0.6, label="mean reward")
        # Step means are noisy (a few prompts each); the trailing mean shows the trend.
        trailing = [sum(means[max(0, i - 4):i + 1]) / len(means[max(0, i - 4):i + 1]) for i in range(len(means))]
        ax.plot(steps, trailing, linewidth=2.5, label="trailing 5-step mean")
    if evals:
        ax.plot([s for s, _ in evals], [v for _, v in evals], marker="s", markersize=5, linewidth=2, color="black",
                label="eval reward (held-out)")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, frameon=False)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    print(plot_reward_curve(sys.argv[1]))
