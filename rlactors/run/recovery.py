"""In-job trainer recovery (`controller.restart_trainer`): a run one of whose trainer ranks died
goes on from its last complete checkpoint instead of stopping.

When a call to the trainer fails because one of its ranks exited or stayed unresponsive and
restarts are left (`TrainerRestarts`), the steps under way end, the controller rebuilds the
trainer on the same hosts from the last complete checkpoint (`recovery_point`; none yet: from
model.path) and pushes that policy to every replica (`Controller.recover_trainer`), and training
goes on from the step after it (`train_with_restarts`), the later steps' records dropped so every
step is recorded once. A death after the last restart stops the run as without recovery. In
full: docs/recovery.md.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from rlactors.run.run_dir import ResumeState, RunDir, TrainingError
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

    def failure(self, cause: str, lost_rank: str | None, stopped: Callable[[str], str]) -> Exception:
        """What a proc's death (`cause`; `lost_rank`: the trainer rank it took, if any) raises:
        TrainerLost where a restart is left for it, counted; else the TrainingError whose line
        `stopped` makes of the cause, saying that no restart was left where restarts were on."""
        if self.allow(lost_rank):
            return TrainerLost(cause)
        if self.limit:
            cause = f"{cause} (the trainer was restarted {self.done} times already, {KEY}={self.limit})"
        return TrainingError(stopped(cause))

    def recovered_line(self, step: int, cause: str, point: RecoveryPoint, seconds: float) -> str:
        """The line that says the trainer was rebuilt and from which step the run trains again."""
        return (f"step {step}: {cause}; the trainer was rebuilt from {point.name} in {seconds:.1f} s "
                f"(restart {self.done} of {KEY}={self.limit}); training again from step {point.state.step + 1}")


History = dict[int, dict[str, float]]  # step -> its metrics


async def train_with_restarts(train: Callable[[History], Awaitable[None]],
                              recover: Callable[[str], Awaitable[int]]) -> list[dict[str, float]]:
    """The metrics of the steps that `train` completes. Each TrainerLost it raises has `recover`
    rebuild the trainer (returning the step it stands at), and `train` goes on from there, the
    steps after that one to be trained again."""
    history: History = {}
    while True:
        try:
            await train(history)
            return list(history.values())
        except TrainerLost as lost:
            step = await recover(str(lost))
            for trained_again in [s for s in history if s > step]:
                del history[trained_again]
