"""A scripted generate and a small env for the Rollouter and RolloutProducer tests."""

import asyncio

from rlactors.config import RolloutConfig
from rlactors.rollout import Observation, Rollouter, StepResult, TokenEnv
from rlactors.types import Completion

STOP = 2


class FakeGenerate:
    """Deterministic async generate: `seed % 4 + 1` tokens ending in STOP, or cut at max_tokens."""

    def __init__(self, fail_sessions=(), error_sessions=(), length=None):
        self.fail_sessions = set(fail_sessions)
        self.error_sessions = set(error_sessions)
        self.length = length
        self.requests = []
        self.in_flight_groups = set()
        self.max_groups_in_flight = 0

    async def __call__(self, prompt, sampling, request_id, session_id=None):
        self.requests.append((request_id, session_id, sampling))
        group = session_id.split("/")[0]
        self.in_flight_groups.add(group)
        self.max_groups_in_flight = max(self.max_groups_in_flight, len(self.in_flight_groups))
        await asyncio.sleep(0.001)
        self.in_flight_groups.discard(group)
        if session_id in self.fail_sessions:
            raise ConnectionError("replica died")
        if session_id in self.error_sessions:
            return Completion(request_id, list(prompt), [], [], [], "error", error="engine error")
        n = self.length or (sampling.seed % 4 + 1)
        tokens = [100 + (sampling.seed + i) % 50 for i in range(n - 1)] + [STOP]
        finish = "stop"
        if len(tokens) > sampling.max_tokens:
            tokens, finish = tokens[:sampling.max_tokens], "length"
        return Completion(request_id, list(prompt), tokens, [-0.5] * len(tokens), [0] * len(tokens), finish)


class LengthRewardEnv(TokenEnv):
    """Reward = number of generated tokens in the turn; `turns` turns per rollout."""

    def __init__(self, config=None, tokenizer=None, turns=1, reward=None, grow=0):
        super().__init__(config, tokenizer)
        self.turns, self.reward, self.grow = turns, reward, grow
        self.stop_token_ids = (STOP,)
        self.prompt, self.turn = [], 0

    def clone(self):
        return LengthRewardEnv(turns=self.turns, reward=self.reward, grow=self.grow)

    async def reset(self, sample):
        self.prompt = [1, 3, 4]
        return Observation(self.prompt)

    async def step(self, completion):
        self.turn += 1
        reward = self.reward if self.reward is not None else float(len(completion.token_ids))
        self.prompt = self.prompt + completion.token_ids + [5] * (1 + self.grow)
        return StepResult(self.prompt, reward=reward, done=self.turn == self.turns)


def rollouter(env, generate=None, **overrides):
    config = RolloutConfig(**{"group_size": 4, "max_turns": 3, "max_total_tokens": 64,
                              "max_tokens_per_turn": 8, "step_timeout_s": 0.2, **overrides})
    return Rollouter(env, generate or FakeGenerate(), config)
