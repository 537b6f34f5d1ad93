"""Rollouts: the env API, the Rollouter, rollout -> episode packing, advantages, the Batcher."""

from rlactors.rollout.batcher import Batcher
from rlactors.rollout.env import (
    HarnessEnv,
    MessageEnv,
    MessageStep,
    ModelTurns,
    OnTokens,
    RewardFunc,
    Rubric,
    SampleStream,
    TokenEnv,
    TurnRefused,
    load_env,
)
from rlactors.rollout.episodes import rollout_to_episodes
from rlactors.rollout.rollouter import Rollouter, summarize
from rlactors.rollout.types import (
    Episode,
    Observation,
    Rollout,
    RolloutBatch,
    RolloutGroup,
    RolloutStatus,
    StepResult,
    Turn,
)

__all__ = [
    "Batcher", "Episode", "HarnessEnv", "MessageEnv", "MessageStep", "ModelTurns", "Observation", "OnTokens",
    "RewardFunc", "Rollout", "RolloutBatch", "RolloutGroup", "RolloutStatus", "Rollouter", "Rubric",
    "SampleStream", "StepResult", "TokenEnv", "Turn", "TurnRefused", "load_env", "rollout_to_episodes", "summarize",
]
