"""Over-long handling in the Rollouter (DAPO): the soft over-long penalty and masking cut rollouts."""

import asyncio

import pytest

from rlactors.config import ConfigError, RolloutConfig, load_config
from rlactors.rollout import Observation, Rollouter, RolloutStatus, StepResult, TokenEnv
from rlactors.types import Completion


class OneTurn(TokenEnv):
    """Every reply earns 1.0 (component "reward"), whatever its length."""

    async def reset(self, sample):
        return Observation([1, 2, 3])

    async def step(self, completion):
        return StepResult(None, 1.0, done=True)


def replies_of_length(lengths):
    """Rollout i of each group generates `lengths[i]` tokens, cut at the sampling limit."""

    async def generate(prompt, sampling, request_id, session_id=None):
        n = lengths[int(request_id.split("/")[1])]
        finish = "length" if n >= sampling.max_tokens else "stop"
        n = min(n, sampling.max_tokens)
        return Completion(request_id, list(prompt), [7] * n, [-1.0] * n, [0] * n, finish)

    return generate


def run_group(lengths, **rollout):
    config = RolloutConfig(group_size=len(lengths), max_turns=1, max_total_tokens=256, max_tokens_per_turn=64,
                           **rollout)
    return asyncio.run(Rollouter(OneTurn(), replies_of_length(lengths), config).collect([{}])).groups[0]


def test_the_penalty_falls_linearly_over_the_buffer():
    group = run_group([10, 48, 56, 64], overlong_buffer_tokens=16, overlong_penalty=0.5)
    assert [r.reward_components["overlong"] for r in group.rollouts] == [0.0, 0.0, -0.25, -0.5]
    assert [r.reward for r in group.rollouts] == [1.0, 1.0, 0.75, 0.5]
    assert group.rollouts[3].status is RolloutStatus.TRUNCATED_LENGTH
    assert len(group.episodes) == 4  # all trained: masking is off


def test_without_a_buffer_there_is_no_penalty():
    group = run_group([10, 64])
    assert [r.reward for r in group.rollouts] == [1.0, 1.0]
    assert all("overlong" not in r.reward_components for r in group.rollouts)


def test_masked_truncated_rollouts_count_in_advantages_but_are_not_trained():
    group = run_group([10, 20, 64, 64], overlong_buffer_tokens=16, mask_truncated=True)
    rewards = [r.reward for r in group.rollouts]
    assert rewards == [1.0, 1.0, 0.0, 0.0]
    assert [r.advantage for r in group.rollouts] == pytest.approx([1.0, 1.0, -1.0, -1.0], abs=1e-5)
    assert [ep.rollout_index for ep in group.episodes] == [0, 1]
    assert all(ep.advantages[-1] == pytest.approx(1.0, abs=1e-5) for ep in group.episodes)

    unmasked = run_group([10, 20, 64, 64], overlong_buffer_tokens=16)
    assert [ep.rollout_index for ep in unmasked.episodes] == [0, 1, 2, 3]


def test_overlong_keys_are_checked_at_load():
    with pytest.raises(ConfigError, match=r"^rollout.overlong_buffer_tokens: must be in \[0, max_tokens_per_turn=64\]"):
        load_config(None, ["rollout.max_tokens_per_turn=64", "rollout.overlong_buffer_tokens=65"])
    with pytest.raises(ConfigError, match="^rollout.overlong_buffer_tokens: must be in"):
        load_config(None, ["rollout.overlong_buffer_tokens=-1"])
    with pytest.raises(ConfigError, match="^rollout.overlong_penalty: must be >= 0 and finite"):
        load_config(None, ["rollout.overlong_penalty=-0.5"])
    with pytest.raises(ConfigError, match="^rollout.mask_truncated: expected a boolean"):
        load_config(None, ["rollout.mask_truncated=1"])
