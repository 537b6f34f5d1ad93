"""A run dir: the files of one training run, and the rules for starting and resuming one there.

    <run_dir>/
        config.toml              the run's config, written at every start
        metrics.jsonl            one record per step and per evaluation (rlactors.run.metrics)
        samples.jsonl            decoded rollouts of each step (controller.log_samples)
        env_errors.log           every env error, with its traceback
        reward_curve.png         drawn from metrics.jsonl
        tensorboard/             TensorBoard events
        wandb_run_id             the W&B run a resumed run goes on logging into
        slurm/                   the Slurm job's logs (job.scheduler = "slurm")
        checkpoints/step_N/      trainer checkpoints, with controller_state.json (the run after step N)

A new run refuses a dir that holds steps; `--resume` continues from the newest intact checkpoint
of a recorded step, or from step 0 (docs/checkpoints.md tells the whole story).
"""

from __future__ import annotations

import errno
import json
import logging
import shutil
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlactors.config import Config, dump_toml, read_toml
from rlactors.procs.placement import first_value
from rlactors.storage.records import is_storage_fault, keep_records_through, read_records, writing
from rlactors.trainer.checkpoint import (
    HF_DIR,
    checkpoint_dir,
    complete_checkpoints,
    is_complete,
    latest_checkpoint,
    newest_intact,
    prune,
)

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.toml"
METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
ENV_ERRORS_FILE = "env_errors.log"
REWARD_CURVE_FILE = "reward_curve.png"
TENSORBOARD_DIR = "tensorboard"
WANDB_RUN_ID_FILE = "wandb_run_id"
SLURM_DIR = "slurm"
CHECKPOINTS_DIR = "checkpoints"
CONTROLLER_STATE = "controller_state.json"  # in each checkpoint's step dir
STEP_RECORD_KEY = "rollout/reward_mean"  # in a step's record in metrics.jsonl, not in an evaluation's
# Settings a resumed run must keep: another env or seed would make it a different run.
FIXED_ON_RESUME = ("env.name", "env.args", "controller.seed")


class TrainingError(RuntimeError):
    """The run cannot go on (a dead trainer, a non-finite loss); the message says why."""


class RunComplete(Exception):
    """`--resume` of a run that has reached controller.steps: there is nothing to train."""


@dataclass
class ResumeState:
    """Where the run stands after a step: what a checkpoint needs beyond the trainer's state."""

    step: int
    policy_version: int
    samples: dict[str, int]
    rollouter: dict[str, int]

    @classmethod
    def read(cls, checkpoint: Path) -> ResumeState:
        return cls(**json.loads((checkpoint / CONTROLLER_STATE).read_text()))


    def files(self) -> dict[str, str]:
        """The files a checkpoint holds beside the trainer's state."""
        return {CONTROLLER_STATE: json.dumps(self.__dict__)}


class RunDir:
    """The run dir at `path`: its file names and its new-run and resume checks."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.checkpoints = self.path / CHECKPOINTS_DIR
        self.config = self.path / CONFIG_FILE
        self.metrics = self.path / METRICS_FILE

    def check(self, config: Config, resume: bool) -> Path | None:
        """A new run never writes over a run dir that holds steps; `--resume` continues the run
        here with its env and seed, and raises RunComplete when it has all its steps. Returns the
        checkpoint to resume from: the newest intact one of a recorded step (None: from step 0)."""
        if not resume:
            # A dir with only config.toml (a run stopped before its first step) holds nothing to lose.
            last = latest_checkpoint(self.checkpoints)
            held = ([METRICS_FILE] if self.metrics.is_file() and self.metrics.stat().st_size else []) + \
                ([f"{CHECKPOINTS_DIR}/{last.name}"] if last else [])
            if held:
                raise TrainingError(f"controller.run_dir: {self.path} already holds a run ({', '.join(held)}); "
                                    f"continue it with --resume (from step 0 if it has no checkpoint), or give "
                                    f"this run another controller.run_dir (or delete {self.path})")
            return None
        for partial in self.checkpoints.glob(".step_*.partial"):  # saves a crash cut short: never loaded
            shutil.rmtree(partial, ignore_errors=True)
        recorded = self.last_recorded_step()
        path = newest_intact(self.checkpoints, through_step=recorded)
        unrecorded = [step for step, _ in complete_checkpoints(self.checkpoints) if step > recorded]
        if unrecorded:
            print(f"--resume: the checkpoint of step {unrecorded[0]} is passed over: the run stopped before "
                  f"writing that step's records (metrics.jsonl ends at step {recorded}), so it is trained again",
                  flush=True)
        if path is None:
            print(f"--resume: no intact checkpoint under {self.checkpoints} (for a recorded step): the run restarts "
                  f"from step 0 (model.path) and its records are cleared", flush=True)
            for name in (METRICS_FILE, SAMPLES_FILE):
                keep_records_through(self.path / name, -1)  # none: step 0's evaluation is made again
            return None
        if not (path / CONTROLLER_STATE).is_file():
            raise TrainingError(f"--resume: {path} has no {CONTROLLER_STATE}")
        self._check_resumed_config(config, path)
        step = ResumeState.read(path).step
        if step >= config.controller.steps:
            raise RunComplete(f"nothing to train: the run in {self.path} is at step {step} and controller.steps "
                              f"is {config.controller.steps}; raise controller.steps to train further")
        return path

    def last_recorded_step(self) -> int:
        """The last step with a record in metrics.jsonl (written after the step's samples), 0 if none."""
        records = read_records(self.metrics, say=lambda line: None)  # torn lines: said when they are dropped
        return max((r["step"] for r in records if STEP_RECORD_KEY in r), default=0)

    def _check_resumed_config(self, config: Config, checkpoint: Path) -> None:
        """Refuses a resume whose env or seed differ from the run's config.toml; prints the other
        settings that changed."""
        if not self.config.is_file():
            return
        saved = _flat_config(read_toml(self.config))
        now = _flat_config(json.loads(json.dumps(config.to_dict())))  # tuples as lists, like TOML's
        changed = {key: (saved[key], now[key]) for key in now if key in saved and saved[key] != now[key]}
        for key in FIXED_ON_RESUME:
            if key in changed:
                was, asked = changed[key]
                raise TrainingError(
                    f"--resume: {key} is {asked!r} here but the run in {self.path} has {was!r} ({self.config}); "
                    f"resume it as it was, or start a new run in another controller.run_dir "
                    f"(model.path=\"{checkpoint / HF_DIR}\" starts from this run's policy)")
        if changed:
            print("resuming with changed settings: "
                  + "; ".join(f"{key} {was!r} -> {asked!r}" for key, (was, asked) in changed.items()), flush=True)

    def write_config(self, config: Config) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        with writing(self.config):
            self.config.write_text(dump_toml(config), encoding="utf-8")

    def is_saved(self, step: int) -> bool:
        """Whether the checkpoint of `step` is complete."""
        return is_complete(checkpoint_dir(self.checkpoints, step))

    async def save(self, trainer: Any, state: ResumeState, keep: int) -> Path:
        """Has `trainer` (a PolicyTrainer mesh) save the checkpoint of `state.step`, with `state`
        in it, then keeps the newest `keep` checkpoints; its path. One it could not write is a
        TrainingError naming why (a storage fault: the path and the fault)."""
        from monarch.actor import ActorError

        try:
            path = await trainer.save_checkpoint.call(str(self.checkpoints), state.step, state.files())
        except ActorError as e:  # the trainer could not write it (every rank raises, none is left waiting)
            what = f"saving the checkpoint of step {state.step} failed"
            if is_storage_fault(e.exception):
                raise TrainingError(self.storage_error(e.exception, what)) from None
            reason = " ".join(f"{type(e.exception).__name__}: {e.exception}".split())
            raise TrainingError(f"{what}: {reason}; {self.last_checkpoint()}") from None
        prune(self.checkpoints, keep)
        return Path(first_value(path))

    def last_checkpoint(self) -> str:
        """Where a stopped run resumes from, for its error line."""
        last = latest_checkpoint(self.checkpoints)
        return f"the last complete checkpoint is {last}" if last else "no checkpoint was completed"

    def resumable(self, what: str) -> str:
        """The error line of a run stopped by `what`: where it resumes from."""
        return f"{what}; {self.last_checkpoint()}; continue with --resume"

    def storage_error(self, error: OSError, what: str = "") -> str:
        """The error line of a run stopped by a storage fault (records.STORAGE_ERRNOS) at a write:
        the path, the fault, and the checkpoint a --resume (when there is one) continues from."""
        fault = f"{error.strerror} ({errno.errorcode.get(error.errno, error.errno)})"
        line = f"{what}{': ' if what else ''}cannot write {error.filename or self.path}: {fault}"
        last = latest_checkpoint(self.checkpoints)
        if last is None:
            return f"{line}; no checkpoint was completed (--resume restarts the run from step 0)"
        return f"{line}; the last complete checkpoint is {last}; once it can be written, continue with --resume"

    async def keep_on_interrupt(self, step: int, save: Callable[[], Awaitable[Any]]) -> str:
        """After Ctrl-C: has `save` save `step` (0: none) unless its checkpoint is complete, then
        prints and returns where the run resumes from, or that nothing was saved."""
        if step and not self.is_saved(step):
            print(f"interrupted: saving step {step} (Ctrl-C again to quit without saving)", file=sys.stderr, flush=True)
            try:
                await save()
            except Exception as e:  # noqa: BLE001 - stopping anyway: say what was kept
                logger.error("saving step %d failed: %s", step, e)
        report = self.interrupt_report(step)
        print(report, file=sys.stderr, flush=True)
        return report

    def interrupt_report(self, step: int) -> str:
        """What a run interrupted after `step` (0: before its first) kept, and how to go on."""
        last = latest_checkpoint(self.checkpoints)
        if last is None:
            return (f"interrupted before step {step + 1} completed: nothing is saved; "
                    "start the run again (without --resume)")
        after = f" after step {step}" if step else ""
        return f"interrupted{after}: the run is saved in {last}; continue with --resume"


def saved_config(config_file: str | Path | None, overrides: Sequence[str]) -> Path | None:
    """The config.toml of the run dir that `config_file` and `overrides` name, if it exists: the
    base of a --resume's config."""
    from rlactors.config import ControllerConfig, parse_override

    run_dir = ControllerConfig.run_dir
    if config_file is not None:
        run_dir = read_toml(config_file).get("controller", {}).get("run_dir", run_dir)
    for keys, value in map(parse_override, overrides):
        if keys == ["controller", "run_dir"]:
            run_dir = value
    path = RunDir(str(run_dir)).config
    return path if path.is_file() else None


def _flat_config(tree: dict[str, Any]) -> dict[str, Any]:
    """`section.key` -> value of a config's sections (env.args stays one value)."""
    return {f"{section}.{key}": value for section, table in tree.items() if isinstance(table, dict)
            for key, value in table.items()}
