"""Envs for the fault-injection suite, loaded by name (`env.name = "fault_envs:FaultyEnv"`, with
tests/faults on PYTHONPATH).

FaultyEnv is a one-turn TokenEnv whose reward varies with what a random tiny model writes (so
advantages, losses and gradients are not zero), and which, with `faults = true`, fails on a fixed
schedule keyed on the request id `g{n}/{i}/t{k}`: the same rollouts fail in every run and after a
resume. In each group (group_size >= 4):

    rollout 0: step raises (even groups)           -> error_env
               step hangs past step_timeout_s (odd) -> error_timeout
    rollout 1: step returns garbage (even groups)   -> error_parse
               step returns a NaN reward (odd)      -> error_parse
    rollout 2: the rubric's reward function raises  -> error_env
    rollout 3+: no fault

With `signal_from_group = n`, groups before group n earn 0 in every rollout: their rewards do
not vary, so GRPO has nothing to train on (a task the policy cannot solve yet). Later groups earn
their rollout's index, which always varies.

With `huge_reward = x`, rollout 0 of group `huge_reward_from_group` and later earns x: finite,
so the rollout is valid, but a Dr.GRPO advantage of that size overflows fp32 in the gradient
(x = 1e30) or in the loss itself (x = 1.7e38, once the ratio leaves the clip range).
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

from rlactors.rollout import Observation, RewardFunc, Rubric, StepResult, TokenEnv
from rlactors.rollout.types import Rollout
from rlactors.types import Completion

VOCAB = 1024


def _ids(request_id: str) -> tuple[int, int]:
    group, index, _turn = request_id.split("/")
    return int(group[1:]), int(index)


class FaultyEnv(TokenEnv):
    @dataclass
    class Config:
        num_samples: int = 64
        faults: bool = False
        hang_s: float = 60.0  # how long the hanging step sleeps (past rollout.step_timeout_s)
        empty: bool = False  # an empty train split
        stop_tokens: int = 0  # ids 3 .. 3 + stop_tokens - 1 end a turn (completions of varied length)
        huge_reward: float = 0.0  # when not 0: what rollout 0 earns from group huge_reward_from_group on
        huge_reward_from_group: int = 0
        signal_from_group: int = 0  # when not 0: earlier groups earn 0 in every rollout, later ones their index

    def __init__(self, config=None, tokenizer=None):
        super().__init__(config, tokenizer)
        funcs = [RewardFunc("faulty_rubric", self._rubric_reward)] if self.config.faults else []
        self.rubric = Rubric(funcs)
        self.stop_token_ids = tuple(range(3, 3 + self.config.stop_tokens))

    def dataset(self, split: str) -> list[list[int]]:
        if self.config.empty:
            return []
        rng = random.Random(split)
        return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(4, 12))] for _ in range(self.config.num_samples)]

    async def reset(self, sample: list[int]) -> Observation:
        return Observation(prompt_token_ids=list(sample))

    async def step(self, completion: Completion):
        # Reward: the share of low token ids, which a random policy spreads over [0, 1].
        reward = sum(t < VOCAB // 2 for t in completion.token_ids) / max(1, len(completion.token_ids))
        group, index = _ids(completion.request_id)
        if self.config.signal_from_group:
            reward = 0.0 if group < self.config.signal_from_group else float(index)
        if self.config.huge_reward and group >= self.config.huge_reward_from_group and index == 0:
            reward = self.config.huge_reward
        if self.config.faults:
            if index == 0 and group % 2 == 0:
                raise RuntimeError(f"injected env failure in {completion.request_id}")
            if index == 0:
                await asyncio.sleep(self.config.hang_s)
            if index == 1 and group % 2 == 0:
                return "garbage"
            if index == 1:
                reward = float("nan")
        return StepResult(None, reward, done=True)

    @staticmethod
    def _rubric_reward(rollout: Rollout) -> float:
        if rollout.index == 2:
            raise ValueError(f"injected reward-function failure in {rollout.session_id}")
        return 0.0
