"""Rollouter: statuses, soft failures, group advantages, zero-variance groups, ids/seeds."""

import asyncio
import math
import sys
from dataclasses import dataclass

import pytest
from support.rollouts import STOP, FakeGenerate, LengthRewardEnv, rollouter

from rlactors.config import ConfigError, EnvConfig
from rlactors.models import load_tokenizer
from rlactors.rollout import (
    MessageEnv,
    MessageStep,
    Observation,
    RewardFunc,
    RolloutStatus,
    Rubric,
    SampleStream,
    StepResult,
    TokenEnv,
    load_env,
)
from rlactors.rollout.advantages import group_advantages
from rlactors.rollout.rollouter import PromptTooLong, prompts_too_long_line


class FlakyEnv(LengthRewardEnv):
    """Each clone plays the next behaviour in `modes`: ok, raise, hang, garbage, bad_reset, bad_reward."""

    def __init__(self, modes, mode="ok"):
        super().__init__(turns=2)
        self.modes, self.mode = modes, mode

    def clone(self):
        return FlakyEnv(self.modes, self.modes.pop(0))

    async def reset(self, sample):
        if self.mode == "bad_reset":
            return {"prompt": "not tokens"}
        return await super().reset(sample)

    async def step(self, completion):
        if self.mode == "raise":
            raise RuntimeError("env bug")
        if self.mode == "hang":
            await asyncio.sleep(3600)
        if self.mode == "garbage":
            return StepResult(next_token_ids=["a", "b"], reward=1.0)
        if self.mode == "bad_reward":
            return StepResult(self.prompt, reward=math.nan)
        return await super().step(completion)


def test_env_that_raises_hangs_or_returns_garbage_is_marked_and_the_group_completes():
    modes = ["ok", "raise", "hang", "garbage", "bad_reset", "bad_reward"]
    r = rollouter(FlakyEnv(list(modes)), group_size=len(modes), error_reward=-1.0)
    group = asyncio.run(r.run_group({"id": 0}))
    statuses = [ro.status for ro in group.rollouts]
    assert statuses == [RolloutStatus.COMPLETED, RolloutStatus.ERROR_ENV, RolloutStatus.ERROR_TIMEOUT,
                        RolloutStatus.ERROR_PARSE, RolloutStatus.ERROR_PARSE, RolloutStatus.ERROR_PARSE]
    ok = group.rollouts[0]
    assert len(ok.turns) == 2 and ok.reward == sum(len(t.token_ids) for t in ok.turns)
    for failed in group.rollouts[1:]:
        assert failed.reward == -1.0 and failed.error
    assert "RuntimeError: env bug" in group.rollouts[1].error
    assert "step_timeout_s" in group.rollouts[2].error
    assert "next_token_ids" in group.rollouts[3].error
    # Where the env raised: its traceback, from the env's own frame on (not the Rollouter's).
    raised = group.rollouts[1].error_traceback.splitlines()
    assert raised[0] == "Traceback (most recent call last):" and raised[-1] == "RuntimeError: env bug"
    assert raised[-3].startswith(f'  File "{__file__}", line ') and raised[-3].endswith(", in step")
    assert raised[-2].strip() == 'raise RuntimeError("env bug")'
    assert not any("rlactors/rollout/rollouter.py" in line or "/asyncio/" in line for line in raised)
    assert [ro.error_traceback for ro in group.rollouts[2:]] == [None] * 4  # a timeout and bad values raise nothing
    # The failed rollouts' generated turns are still trained, carrying the error reward's advantage.
    assert {ep.rollout_index for ep in group.episodes} == {0, 1, 2, 3, 5}
    assert group.rollouts[0].advantage > 0 > group.rollouts[1].advantage


def test_failing_clone_or_reward_function_is_marked():
    class CloneFails(LengthRewardEnv):
        def clone(self):
            raise OSError("no sandbox left")

    group = asyncio.run(rollouter(CloneFails(), error_reward=-2.0).run_group({}))
    assert {(ro.status, ro.reward, ro.turns == []) for ro in group.rollouts} == {(RolloutStatus.ERROR_ENV, -2.0, True)}
    assert "OSError: no sandbox left" in group.rollouts[0].error and group.episodes == []

    class RubricFails(LengthRewardEnv):
        def __init__(self, value):
            super().__init__()
            self.value = value
            self.rubric = Rubric([RewardFunc("judge", self.judge)])

        def clone(self):
            return RubricFails(self.value)

        async def judge(self, rollout):
            if isinstance(self.value, Exception):
                raise self.value
            return self.value

    raised = asyncio.run(rollouter(RubricFails(KeyError("answer"))).run_group({}))
    assert {ro.status for ro in raised.rollouts} == {RolloutStatus.ERROR_ENV}
    assert "rubric.score raised KeyError" in raised.rollouts[0].error
    nan = asyncio.run(rollouter(RubricFails(math.nan)).run_group({}))
    assert {ro.status for ro in nan.rollouts} == {RolloutStatus.ERROR_PARSE}
    for value in (1e39, -1.8e38):  # finite, but their advantages would overflow the trainer's fp32
        huge = asyncio.run(rollouter(RubricFails(value)).run_group({}))
        assert {ro.status for ro in huge.rollouts} == {RolloutStatus.ERROR_PARSE}, value
        assert f"rubric total is {value}, not a number within +-1.701e+38" in huge.rollouts[0].error
    assert asyncio.run(rollouter(RubricFails(1.7e38)).run_group({})).rollouts[0].status == RolloutStatus.COMPLETED

    class NoRubric(LengthRewardEnv):
        def clone(self):
            env = NoRubric()
            env.rubric = None
            return env

    broken = asyncio.run(rollouter(NoRubric()).run_group({}))
    assert {ro.status for ro in broken.rollouts} == {RolloutStatus.ERROR_ENV}
    assert broken.rollouts[0].error.startswith("AttributeError")
    assert broken.rollouts[0].reward_components == {"reward": float(len(broken.rollouts[0].turns[0].token_ids))}


def test_generator_failure_marks_only_that_rollout():
    generate = FakeGenerate(fail_sessions={"g0/1"}, error_sessions={"g0/2"})
    group = asyncio.run(rollouter(LengthRewardEnv(turns=2), generate).run_group({}))
    statuses = [ro.status for ro in group.rollouts]
    assert statuses == [RolloutStatus.COMPLETED, RolloutStatus.ERROR_GENERATOR,
                        RolloutStatus.ERROR_GENERATOR, RolloutStatus.COMPLETED]
    assert "ConnectionError: replica died" in group.rollouts[1].error
    assert group.rollouts[2].error == "engine error"


def test_truncation_statuses():
    turns = asyncio.run(rollouter(LengthRewardEnv(turns=10)).run_group({}))
    assert {ro.status for ro in turns.rollouts} == {RolloutStatus.TRUNCATED_TURNS}
    assert all(len(ro.turns) == 3 for ro in turns.rollouts)

    length = asyncio.run(rollouter(LengthRewardEnv(turns=2), FakeGenerate(length=20)).run_group({}))
    assert {ro.status for ro in length.rollouts} == {RolloutStatus.TRUNCATED_LENGTH}
    assert all(len(ro.turns) == 1 and len(ro.turns[0].token_ids) == 8 for ro in length.rollouts)
    assert all(ro.reward == 8.0 for ro in length.rollouts)  # the cut turn was still scored

    # The env's reply adds 61 tokens: the second prompt leaves no room in max_total_tokens=64.
    context = asyncio.run(rollouter(LengthRewardEnv(turns=3, grow=60)).run_group({}))
    assert {ro.status for ro in context.rollouts} == {RolloutStatus.TRUNCATED_CONTEXT}
    assert all(len(ro.turns) == 1 for ro in context.rollouts)


def test_max_tokens_of_a_turn_shrinks_to_the_room_left():
    generate = FakeGenerate(length=3)
    asyncio.run(rollouter(LengthRewardEnv(turns=3, grow=30), generate, max_total_tokens=40).run_group({}))
    # prompt 3 tokens -> room 37, capped at 8; then 3 + 3 + 31 = 37 tokens -> room 3.
    budgets = [s.max_tokens for rid, _, s in generate.requests if rid.startswith("g0/0/")]
    assert budgets == [8, 3]


def test_group_advantages_grpo_and_dr_grpo():
    rewards = [1.0, 0.0, 0.0, 3.0]
    std = math.sqrt(((1 - 1) ** 2 + 1 + 1 + 4) / 4)
    assert group_advantages(rewards, "grpo") == pytest.approx([0.0, -1 / std, -1 / std, 2 / std], rel=1e-5)
    assert group_advantages(rewards, "dr_grpo") == [0.0, -1.0, -1.0, 2.0]
    with pytest.raises(ValueError, match="advantage method"):
        group_advantages(rewards, "ppo")
    with pytest.raises(ValueError, match="finite"):
        group_advantages([1.0, math.inf], "grpo")


def test_zero_variance_groups_are_dropped_and_counted_or_kept():
    env = LengthRewardEnv(reward=1.0)
    batch = asyncio.run(rollouter(env).collect([{"id": i} for i in range(3)]))
    assert batch.episodes == []
    assert batch.metrics["rollout/groups_zero_variance"] == 3.0
    assert batch.metrics["rollout/groups_dropped"] == 3.0
    assert batch.metrics["rollout/status/completed"] == 12.0

    kept = asyncio.run(rollouter(env, keep_zero_variance_groups=True).collect([{"id": 0}]))
    assert kept.metrics["rollout/groups_dropped"] == 0.0 and len(kept.episodes) == 4
    assert all(a == 0.0 for ep in kept.episodes for a in ep.advantages)


def test_ids_and_seeds_are_unique_across_the_run_and_a_resume():
    generate = FakeGenerate()
    first = rollouter(LengthRewardEnv(turns=3), generate)
    asyncio.run(first.collect([{}, {}]))
    resumed = rollouter(LengthRewardEnv(turns=3), generate)
    resumed.load_state_dict(first.state_dict())
    batch = asyncio.run(resumed.collect([{}, {}]))
    assert [g.group_id for g in batch.groups] == ["g2", "g3"]
    request_ids = [rid for rid, _, _ in generate.requests]
    seeds = [s.seed for _, _, s in generate.requests]
    assert len(set(request_ids)) == len(request_ids) == 4 * 4 * 3
    assert len(set(seeds)) == len(seeds)
    sessions = {sid for _, sid, _ in generate.requests}
    assert len(sessions) == 16  # one sticky session per rollout, shared by its turns
    assert all(s.stop_token_ids == (STOP,) for _, _, s in generate.requests)


def test_rubric_weights_turn_rewards_and_adds_rollout_rewards():
    class RubricEnv(LengthRewardEnv):
        def __init__(self):
            super().__init__(turns=2)
            self.rubric = Rubric([RewardFunc("turns_used", lambda ro: float(len(ro.turns)), weight=0.5)],
                                 weights={"reward": 2.0})

        def clone(self):
            return RubricEnv()

    group = asyncio.run(rollouter(RubricEnv()).run_group({}))
    for ro in group.rollouts:
        generated = sum(len(t.token_ids) for t in ro.turns)
        assert ro.reward_components == {"reward": generated, "turns_used": 2.0}
        assert ro.reward == 2.0 * generated + 0.5 * 2.0
    with pytest.raises(ValueError, match="unique"):
        Rubric([RewardFunc("a", len), RewardFunc("a", len)])


def test_load_env_builds_config_and_names_bad_keys():
    class_path = f"{__name__}:CountingEnv"
    env = load_env(EnvConfig(name=class_path, args={"turns": 2}))
    assert isinstance(env, CountingEnv) and env.config.turns == 2
    with pytest.raises(ConfigError, match="env.args.turnz: unknown key"):
        load_env(EnvConfig(name=class_path, args={"turnz": 2}))
    with pytest.raises(ConfigError, match="env.args.turns: expected an integer"):
        load_env(EnvConfig(name=class_path, args={"turns": "two"}))
    with pytest.raises(ConfigError, match=r"^env\.name: no module named 'no_such_module_xyz' \(looked in the "):
        load_env(EnvConfig(name="no_such_module_xyz:Env"))
    with pytest.raises(ConfigError, match=rf"^env\.name: module '{__name__}' \(.*\) has no 'NoSuchEnv'$"):
        load_env(EnvConfig(name=f"{__name__}:NoSuchEnv"))
    with pytest.raises(ConfigError, match="not a TokenEnv subclass"):
        load_env(EnvConfig(name=f"{__name__}:FakeGenerate"))


def test_load_env_finds_modules_in_the_working_directory(tmp_path, monkeypatch):
    package = tmp_path / "my_envs_in_cwd"
    package.mkdir()
    (package / "reverse.py").write_text(
        "from rlactors.rollout import TokenEnv\n\nclass ReverseEnv(TokenEnv):\n    pass\n")
    (package / "broken.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert type(load_env(EnvConfig(name="my_envs_in_cwd.reverse:ReverseEnv"))).__name__ == "ReverseEnv"
    assert sys.path[-1] == str(tmp_path)  # after the installed packages: it never shadows one
    with pytest.raises(ConfigError, match=r"^env\.name: no module named 'my_envs_in_cwd.nope' \(looked in the "
                                          rf"working directory {tmp_path} and on sys.path\)$"):
        load_env(EnvConfig(name="my_envs_in_cwd.nope:Env"))
    # A module that is there but fails to import names its own missing dependency.
    with pytest.raises(ConfigError, match=r"^env\.name: module 'my_envs_in_cwd.broken' cannot be imported: "
                                          r"No module named 'no_such_dependency_xyz'$"):
        load_env(EnvConfig(name="my_envs_in_cwd.broken:Env"))


class CountingEnv(TokenEnv):
    @dataclass
    class Config:
        turns: int = 1


def test_sample_stream_is_deterministic_and_resumable():
    data = list(range(7))
    a = SampleStream(data, seed=3)
    taken = a.next(5) + a.next(5)  # crosses an epoch boundary
    assert sorted(taken[:7]) == data and len(set(taken[7:])) == 3
    b = SampleStream(data, seed=3)
    b.next(4)
    c = SampleStream(data, seed=3)
    c.load_state_dict(b.state_dict())
    assert c.next(6) == taken[4:10]
    assert SampleStream(data, seed=4).next(7) != SampleStream(data, seed=3).next(7)
    endless = iter(SampleStream(data, seed=3))
    assert [next(endless) for _ in range(10)] == taken
    with pytest.raises(ValueError, match="seed"):
        SampleStream(data, seed=4).load_state_dict(b.state_dict())
    with pytest.raises(ValueError, match="non-empty"):
        SampleStream([], seed=0)


class WrongTypesChatEnv(MessageEnv):
    """Each clone plays the next of `modes`: a MessageEnv whose start or respond returns the wrong type."""

    def __init__(self, tokenizer, modes, mode="ok"):
        super().__init__(None, tokenizer)
        self.modes, self.mode = modes, mode

    def clone(self):
        return WrongTypesChatEnv(self.tokenizer, self.modes, self.modes.pop(0))

    async def start(self, sample):
        return {"start_int": 42, "start_no_content": [{"role": "user"}]}.get(
            self.mode, [{"role": "user", "content": "hi"}])

    async def respond(self, reply, completion):
        if self.mode == "respond_dict":
            return {"messages": None, "reward": 1.0}
        if self.mode == "respond_text":
            return MessageStep("more please", reward=0.5)
        return MessageStep(None, reward=1.0, done=True)


def test_message_env_returning_wrong_types_ends_error_parse_saying_what_was_expected(tiny_ckpt):
    modes = ["ok", "start_int", "start_no_content", "respond_dict", "respond_text"]
    env = WrongTypesChatEnv(load_tokenizer(tiny_ckpt), list(modes))
    group = asyncio.run(rollouter(env, group_size=len(modes), step_timeout_s=60).run_group({}))
    assert [ro.status for ro in group.rollouts] == [RolloutStatus.COMPLETED] + [RolloutStatus.ERROR_PARSE] * 4
    messages = "must return a non-empty list of {'role': str, 'content': str} messages, got"
    assert [ro.error for ro in group.rollouts] == [
        None,
        f"env reset: start {messages} int 42",
        f"env reset: start {messages} list [{{'role': 'user'}}]",
        "env step: respond must return a MessageStep, got dict {'messages': None, 'reward': 1.0}",
        f"env step: MessageStep.messages {messages} str 'more please'"]
    assert [ro.error_traceback for ro in group.rollouts[1:]] == [None] * 4


def test_prompts_that_leave_no_room_are_named_at_load_and_counted_per_step():
    class PromptOfSampleLength(LengthRewardEnv):
        def clone(self):
            return PromptOfSampleLength()

        async def reset(self, sample):
            self.prompt = [1] * sample["length"]
            return Observation(self.prompt)

    samples = [{"id": "a.jsonl:1", "length": 10}, {"id": "a.jsonl:2", "length": 64}, {"length": 63},
               {"length": 100}, {"id": "a.jsonl:5", "length": 3}]
    r = rollouter(PromptOfSampleLength(), max_total_tokens=64, step_timeout_s=60, keep_zero_variance_groups=True)
    found = asyncio.run(r.prompts_too_long(samples))
    assert found == [PromptTooLong(1, "a.jsonl:2", 64), PromptTooLong(3, "sample 3", 100)]
    assert prompts_too_long_line(found, len(samples), 64, shown=1) == (
        "warning: 2 of 5 train samples have a prompt of at least rollout.max_total_tokens=64 tokens, which leaves "
        "no room to generate: a.jsonl:2 (64 tokens) and 1 more. Their rollouts end truncated_context without a "
        "turn and train nothing (counted per step as rollout/prompts_too_long); raise rollout.max_total_tokens "
        "(and generator.max_model_len) or shorten those prompts")
    batch = asyncio.run(r.collect(samples))
    assert batch.metrics["rollout/prompts_too_long"] == 2
    for group, sample in zip(batch.groups, samples):
        assert all(ro.prompt_token_ids == [1] * sample["length"] for ro in group.rollouts)  # kept, turn or no turn
        too_long = sample["length"] >= 64
        assert all(ro.prompt_too_long == too_long and (ro.turns == []) == too_long for ro in group.rollouts)
        assert (group.episodes == []) == too_long
