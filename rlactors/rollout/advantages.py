"""Group-relative advantages: every rollout of a prompt is compared with its siblings."""

from __future__ import annotations

import math
import typing
from collections.abc import Sequence

from rlactors.config import AdvantageMethod

ADVANTAGE_METHODS = typing.get_args(AdvantageMethod)

# Rewards closer than this are "the same": the group carries no learning signal.
ZERO_VARIANCE_TOL = 1e-8


def group_advantages(rewards: Sequence[float], method: str, eps: float = 1e-6) -> list[float]:
    """GRPO: (r - mean) / (std + eps), std over the group (population); Dr.GRPO: r - mean.

    Dr.GRPO drops the std division because it up-weights prompts that are nearly solved or
    nearly failed (small std), a difficulty bias.
    """
    if method not in ADVANTAGE_METHODS:
        raise ValueError(f"advantage method must be one of {ADVANTAGE_METHODS}, got {method!r}")
    if not rewards:
        raise ValueError("group_advantages needs at least one reward")
    if not all(math.isfinite(r) for r in rewards):
        raise ValueError(f"rewards must be finite, got {list(rewards)}")
    mean = sum(rewards) / len(rewards)
    centered = [r - mean for r in rewards]
    if method == "dr_grpo":
        return centered
    std = math.sqrt(sum(c * c for c in centered) / len(rewards))
    return [c / (std + eps) for c in centered]


def is_zero_variance(rewards: Sequence[float]) -> bool:
    return max(rewards) - min(rewards) <= ZERO_VARIANCE_TOL
