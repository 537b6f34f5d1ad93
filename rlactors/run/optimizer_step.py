"""One optimizer step of the trainer on a step's episodes: packed, the loss normalised over the
step, forward-backward on every rank, then the step itself, with the push of the policy it makes
sent as it ends where the weight sync does so. A step the trainer skipped (a non-finite gradient,
even under a finite loss) is `UpdateSkipped`: the weights are still the last step's, and the next
steps would only repeat the overflow."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from typing import Any

from rlactors.config import Config
from rlactors.procs.placement import first_value
from rlactors.rollout.types import Episode
from rlactors.run.metrics import optimizer_metrics
from rlactors.trainer.losses import LossNorm

Push = Callable[[], Awaitable[dict[str, float]]]


class UpdateSkipped(Exception):
    """The trainer skipped the step's update; the message gives the loss and gradient norm."""


async def optimizer_step(trainer: Any, batcher: Any, config: Config, episodes: list[Episode], push: Push | None,
                         teacher: Any = None
                         ) -> tuple[dict[str, float], asyncio.Future[dict[str, float]] | None, int | None]:
    """One optimizer step of `trainer` (a PolicyTrainer mesh) on `episodes`, scored by `teacher`
    (a Teacher mesh) where the run distills: its metrics, the push started by `push` as the step
    ends (None: no push with the step), and the policy version it made (None: no token to train
    on, so no step)."""
    from rlactors.actors.trainer import forward_backward

    packed = batcher.pack(episodes)
    max_tokens = config.rollout.max_tokens_per_turn * config.rollout.max_turns
    norm = LossNorm.for_step([mb for mbs in packed.per_rank for mb in mbs], config.loss.name, max_tokens)
    if norm.num_tokens == 0:
        return dict(packed.metrics), None, None
    await forward_backward(trainer, packed.per_rank, norm, config.loss, teacher)
    # The new policy goes out as the optimizer step ends, with no call between them.
    pushing = asyncio.ensure_future(push()) if push is not None else None
    try:
        optim = first_value(await trainer.optim_step.call())
    except BaseException:
        _let_go(pushing)
        raise
    if not math.isfinite(optim["loss"]) or optim["update_skipped"]:
        # A push sent with the step (of the last step's weights, refused by every replica as
        # another version) ends before the caller's save reads those weights too.
        if pushing is not None:
            await asyncio.wait([pushing])
            _let_go(pushing)
        raise UpdateSkipped(f"the loss is {optim['loss']} (gradient norm {optim['grad_norm']})")
    version = int(optim.pop("policy_version"))
    return {**optimizer_metrics(optim), **packed.metrics}, pushing, version


def _let_go(pushing: asyncio.Future | None) -> None:
    """Leaves a push that the step's failure makes moot to end by itself, its outcome unread."""
    if pushing is not None:
        pushing.add_done_callback(lambda f: f.cancelled() or f.exception())
