"""In-job trainer recovery (`controller.restart_trainer`): a run one of whose trainer ranks died
goes on from its last complete checkpoint instead of stopping.

When a call to the trainer fails because one of its ranks exited or stayed unresponsive (the
watcher's verdict, rlactors.procs.liveness) and restarts are left, the controller
(`Controller.recover_trainer`):

1. ends the steps under way (their rollouts are cancelled; the generators keep serving);
2. stops the trainer's procs that are left, killing those that do not stop, and spawns a new
   trainer mesh on the same hosts (`Meshes.respawn_trainer`);
3. loads the last complete checkpoint into it, with the sample stream's and the rollouter's
   states saved beside it; with none yet, the run starts again from model.path (step 0);
4. pushes that policy to every replica (the normal weight sync; by broadcast, in a new group);
5. trains again from the step after it. The training loop starts as a resumed run does: the
   records of the steps after the checkpoint (metrics.jsonl, samples.jsonl, TensorBoard) are
   dropped, so every step is recorded once.

A run restarts its trainer at most `controller.restart_trainer` times; a death after that stops
it as one does without recovery (continue with --resume).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlactors.run.run_dir import ResumeState, RunDir
from rlactors.trainer.checkpoint import latest_checkpoint

KEY = "controller.restart_trainer"


class TrainerLost(Exception):
    """A trainer rank died and the run may rebuild its trainer; the message is the cause."""


@dataclass(frozen=True)
class RecoveryPoint:
    """Where a rebuilt trainer starts: a complete checkpoint (None: model.path) and the state of
    the run after its step."""

    checkpoint: Path | None
    state: ResumeState

    @property
    def name(self) -> str:
        return str(self.checkpoint) if self.checkpoint is not None else "model.path (no checkpoint yet)"


def recovery_point(run_dir: RunDir, start: ResumeState) -> RecoveryPoint:
    """The last complete checkpoint of `run_dir`; with none, `start` (the run's state at step 0)."""
    last = latest_checkpoint(run_dir.checkpoints)
    if last is None:
        return RecoveryPoint(None, start)
    return RecoveryPoint(last, ResumeState.read(last))


class TrainerRestarts:
    """Counts the trainer's restarts against `limit` (controller.restart_trainer)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.done = 0

    def allow(self, lost_rank: str | None) -> bool:
        """Whether a failure whose lost trainer rank is `lost_rank` (None: not a trainer rank's
        death) may be recovered from; counts the restart when it may."""
        if lost_rank is None or self.done >= self.limit:
            return False
        self.done += 1
        return True

    def exhausted(self, cause: str) -> str:
        """`cause` of a death that stops the run, saying that no restart was left where restarts were on."""
        if self.limit == 0:
            return cause
        return f"{cause} (the trainer was restarted {self.done} times already, {KEY}={self.limit})"

    def recovered_line(self, step: int, cause: str, point: RecoveryPoint, seconds: float) -> str:
        """The line that says the trainer was rebuilt and from which step the run trains again."""
        return (f"step {step}: {cause}; the trainer was rebuilt from {point.name} in {seconds:.1f} s "
                f"(restart {self.done} of {KEY}={self.limit}); training again from step {point.state.step + 1}")
