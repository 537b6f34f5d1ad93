"""An env for the evaluation tests, loaded by name (`env.name = "support.eval_envs:SplitEnv"`;
tests/ is on sys.path under pytest).

SplitEnv is a one-turn TokenEnv over two disjoint splits of random prompts. Its reward is the
share of low token ids in the reply, which a random tiny model spreads over [0, 1], so groups vary
and every step trains. Every scored turn is recorded in `SplitEnv.seen` (this process's envs:
the controller and the evaluate command run them), so a test can check which split each request
id was given and which policy versions generated it. With `eval_step_s`, scoring an eval sample
takes that long (a slow evaluation).
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any

from rlactors.rollout import Observation, StepResult, TokenEnv
from rlactors.types import Completion

VOCAB = 1024


@dataclass
class Seen:
    split: str
    sample_id: int
    request_id: str
    versions: list[int]
    token_ids: list[int]


class SplitEnv(TokenEnv):
    seen: list[Seen] = []

    @dataclass
    class Config:
        num_samples: int = 32
        num_eval_samples: int = 8
        eval_step_s: float = 0.0

    def dataset(self, split: str) -> list[dict[str, Any]]:
        rng = random.Random(split)
        size = self.config.num_samples if split == "train" else self.config.num_eval_samples
        return [{"split": split, "id": i, "prompt": [rng.randrange(3, VOCAB) for _ in range(rng.randint(4, 12))]}
                for i in range(size)]

    async def reset(self, sample: dict[str, Any]) -> Observation:
        self.sample = sample
        return Observation(prompt_token_ids=list(sample["prompt"]))

    async def step(self, completion: Completion) -> StepResult:
        SplitEnv.seen.append(Seen(self.sample["split"], self.sample["id"], completion.request_id,
                                  list(completion.versions), list(completion.token_ids)))
        if self.sample["split"] == "eval" and self.config.eval_step_s:
            await asyncio.sleep(self.config.eval_step_s)
        reward = sum(t < VOCAB // 2 for t in completion.token_ids) / max(1, len(completion.token_ids))
        return StepResult(None, reward, done=True)
