"""Envs that misbehave in ways a run must survive or say out loud (imported by name, `hazard_envs:...`)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from fault_envs import FaultyEnv

from rlactors.rollout import StepResult
from rlactors.types import Completion


class BlockingEnv(FaultyEnv):
    """FaultyEnv whose step blocks the event loop (`time.sleep`, as a blocking client would) for
    `block_s` seconds, from group `block_from_group` on."""

    @dataclass
    class Config(FaultyEnv.Config):
        block_s: float = 600.0
        block_from_group: int = 0

    async def step(self, completion: Completion) -> StepResult:
        group = int(completion.request_id.split("/")[0][1:])
        if group >= self.config.block_from_group:
            time.sleep(self.config.block_s)
        return await super().step(completion)
