"""Rollout -> Episode packing through the real Rollouter: one sequence per multi-turn rollout."""

import asyncio

import pytest

from rlactors.config import RolloutConfig
from rlactors.rollout import Observation, Rollouter, RolloutStatus, StepResult, TokenEnv, rollout_to_episodes
from rlactors.rollout.types import Rollout, Turn
from rlactors.types import Completion

STOP = 2


class RecordingGenerate:
    """Deterministic fake generator that records every prompt it was given."""

    def __init__(self):
        self.calls = []

    async def __call__(self, prompt, sampling, request_id, session_id=None):
        self.calls.append((request_id, list(prompt)))
        n = 2 + sampling.seed % 3
        tokens = [100 + (sampling.seed * 7 + len(prompt) + i) % 50 for i in range(n)] + [STOP]
        return Completion(request_id=request_id, prompt_token_ids=list(prompt), token_ids=tokens,
                          logprobs=[-0.01 * (len(prompt) + i) for i in range(len(tokens))],
                          versions=[5 + i % 2 for i in range(len(tokens))], finish_reason="stop")


class ThreeTurnEnv(TokenEnv):
    """Appends env tokens after each completion; optionally rewrites history before turn 3."""

    def __init__(self, config=None, tokenizer=None, rewrite=False):
        super().__init__(config, tokenizer)
        self.rewrite = rewrite
        self.turn = 0

    def clone(self):
        return ThreeTurnEnv(rewrite=self.rewrite)

    async def reset(self, sample):
        self.prompt = [1, 10, 11, 12]
        return Observation(self.prompt)

    async def step(self, completion):
        self.turn += 1
        if self.turn == 3:
            return StepResult(None, reward=float(len(completion.token_ids)), done=True)
        self.prompt = self.prompt + completion.token_ids + [20 + self.turn, 30, 31]
        if self.rewrite and self.turn == 2:
            self.prompt = [1, 99] + self.prompt[-3:]  # a summary replaces the history
        return StepResult(self.prompt, reward=1.0)


def run(env, group_size=1):
    config = RolloutConfig(group_size=group_size, advantage="dr_grpo", keep_zero_variance_groups=True)
    generate = RecordingGenerate()
    rollouter = Rollouter(env, generate, config)
    group = asyncio.run(rollouter.run_group({"id": 0}))
    return group, generate.calls


def test_three_turn_rollout_is_one_episode_equal_to_what_the_generator_saw():
    group, calls = run(ThreeTurnEnv())
    rollout = group.rollouts[0]
    assert rollout.status == RolloutStatus.COMPLETED and len(rollout.turns) == 3
    [episode] = group.episodes
    # No re-tokenization drift: the episode is exactly the last prompt the generator saw plus
    # the last completion, and every earlier prompt is a prefix of it.
    last = rollout.turns[-1]
    assert episode.token_ids == calls[-1][1] + last.token_ids
    for _, prompt in calls:
        assert episode.token_ids[:len(prompt)] == prompt
    # The trained tokens are exactly the generated ones, in order, with their logprobs/versions.
    mask = episode.loss_mask
    assert [t for t, m in zip(episode.token_ids, mask) if m] == [t for turn in rollout.turns for t in turn.token_ids]
    assert [x for x, m in zip(episode.generator_logprobs, mask) if m] == [x for t in rollout.turns for x in t.logprobs]
    assert [v for v, m in zip(episode.versions, mask) if m] == [v for t in rollout.turns for v in t.versions]
    assert all(v == -1 and lp == 0.0 for v, lp, m in zip(episode.versions, episode.generator_logprobs, mask) if not m)
    # Env tokens and the prompt are context only.
    env_tokens = [t for t, m in zip(episode.token_ids, mask) if not m]
    assert env_tokens == [1, 10, 11, 12, 21, 30, 31, 22, 30, 31]
    assert episode.advantages == [rollout.advantage if m else 0.0 for m in mask]
    assert episode.num_loss_tokens == rollout.num_generated_tokens


def test_history_rewrite_starts_a_branch_episode():
    group, calls = run(ThreeTurnEnv(rewrite=True))
    rollout = group.rollouts[0]
    first, second = group.episodes
    assert (first.branch, second.branch) == (0, 1)
    # Branch 0: turns 1 and 2 (turn 2's prompt extended turn 1); branch 1: the rewritten prompt + turn 3.
    assert first.token_ids == calls[1][1] + rollout.turns[1].token_ids
    assert second.token_ids == calls[2][1] + rollout.turns[2].token_ids
    assert second.token_ids[:2] == [1, 99]
    generated = [t for ep in (first, second) for t, m in zip(ep.token_ids, ep.loss_mask) if m]
    assert generated == [t for turn in rollout.turns for t in turn.token_ids]
    assert first.reward == second.reward == rollout.reward


def test_advantage_is_spread_over_generated_tokens_of_every_group_member():
    group, _ = run(ThreeTurnEnv(), group_size=4)
    rewards = [r.reward for r in group.rollouts]
    mean = sum(rewards) / len(rewards)
    for rollout, episode in zip(group.rollouts, group.episodes):
        assert rollout.advantage == pytest.approx(rollout.reward - mean)
        assert {a for a, m in zip(episode.advantages, episode.loss_mask) if m} == {rollout.advantage}


def test_turn_without_generated_tokens_makes_no_episode():
    rollout = Rollout(group_id="g0", index=0, session_id="g0/0", seed=0, sample=None,
                      turns=[Turn([1, 2], [], [], [], "stop")])
    assert rollout_to_episodes(rollout) == []


def test_routed_experts_follow_the_generated_tokens_and_are_none_if_a_turn_lacks_them():
    def turn(prompt, tokens, experts):
        return Turn(prompt_token_ids=prompt, token_ids=tokens, logprobs=[-0.1] * len(tokens),
                    versions=[0] * len(tokens), finish_reason="stop", routed_experts=experts)

    first = turn([1, 2], [3, 4], [[[0, 1]], [[2, 3]]])
    second = turn([1, 2, 3, 4, 9], [5], [[[4, 5]]])
    rollout = Rollout(group_id="g", index=0, session_id="s", seed=0, sample=None, turns=[first, second])
    [episode] = rollout_to_episodes(rollout)
    assert episode.routed_experts == [None, None, [[0, 1]], [[2, 3]], None, [[4, 5]]]
    second.routed_experts = None  # a generator that returns none
    [episode] = rollout_to_episodes(rollout)
    assert episode.routed_experts is None
