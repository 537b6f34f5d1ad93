"""HarnessEnv rollouts (the env drives its own turns, as AgentEnv's harnesses do), with a scripted
generate function: limits, ids, seeds, statuses and timeouts as for TokenEnv turns."""

from __future__ import annotations

import asyncio

from rlactors.config import RolloutConfig
from rlactors.rollout import HarnessEnv, Rollouter, RolloutStatus, TurnRefused
from rlactors.types import Completion

CONFIG = RolloutConfig(group_size=2, max_turns=3, max_total_tokens=40, max_tokens_per_turn=4, step_timeout_s=0.5,
                       keep_zero_variance_groups=True)


class Generator:
    """Replies `length` tokens (finish 'length' when they fill max_tokens); records the calls."""

    def __init__(self, length: int = 2, delay: float = 0.0, fail: bool = False):
        self.length, self.delay, self.fail, self.calls = length, delay, fail, []

    async def __call__(self, prompt, sampling, request_id, session_id=None):
        self.calls.append((request_id, session_id, sampling))
        await asyncio.sleep(self.delay)
        if self.fail:
            raise RuntimeError("replica died")
        n = min(self.length, sampling.max_tokens)
        finish = "length" if n == sampling.max_tokens and n == self.length and self.length > 2 else "stop"
        return Completion(request_id, list(prompt), [7] * n, [-0.5] * n, [1] * n, finish)


class Harness(HarnessEnv):
    """Plays `turns` turns (each prompt extends the last), then returns `reward`; `script` may
    change that: 'catch' swallows TurnRefused, 'idle' sleeps after a turn, 'long' sends a long prompt."""

    turns, reward, script = 2, 1.0, ""

    def clone(self):
        env = type(self)()
        env.turns, env.reward, env.script = self.turns, self.reward, self.script
        self.clones.append(env)
        return env

    def __init__(self):
        super().__init__()
        self.clones = []

    async def play(self, sample, model):
        prompt = [1, 2, 3] * (20 if self.script == "long" else 1)
        if self.script == "parallel":  # two calls at once: turns t0 and t1, one after the other
            first, second = await asyncio.gather(model(prompt), model(prompt + [5]))
            return self.reward
        if self.script == "leave":  # one turn, then a call left running when play returns
            turn = await model(prompt)
            self.left = asyncio.ensure_future(model(prompt + turn.token_ids + [4]))
            await asyncio.sleep(0.05)
            return self.reward
        for _ in range(self.turns):
            try:
                turn = await model(prompt, max_tokens=3 if self.script == "max3" else None, stop_token_ids=[9])
            except TurnRefused:
                if self.script == "catch":
                    return self.reward
                raise
            if self.script == "idle":
                await asyncio.sleep(5)
            prompt = prompt + turn.token_ids + [4]
        return self.reward


def play(turns=2, reward=1.0, script="", config=CONFIG, **generator):
    env = Harness()
    env.turns, env.reward, env.script = turns, reward, script
    gen = Generator(**generator)
    batch = asyncio.run(Rollouter(env, gen, config, seed=5).collect([{"id": 0}]))
    return batch, batch.groups[0].rollouts, gen


def test_turns_use_the_rollouts_ids_seeds_and_limits_and_the_reward_is_the_last_turns():
    batch, rollouts, gen = play(script="max3")
    for rollout in rollouts:
        assert rollout.status is RolloutStatus.COMPLETED and rollout.reward == 1.0 and rollout.error is None
        assert [len(t.token_ids) for t in rollout.turns] == [2, 2]
        assert rollout.turns[-1].reward == {"reward": 1.0} and rollout.turns[0].reward == {}
    assert sorted(c[0] for c in gen.calls) == ["g0/0/t0", "g0/0/t1", "g0/1/t0", "g0/1/t1"]
    for request_id, session_id, sampling in gen.calls:
        rollout = rollouts[int(request_id.split("/")[1])]
        assert session_id == rollout.session_id and request_id.startswith(session_id)
        assert sampling.seed == rollout.seed * CONFIG.max_turns + int(request_id[-1])
        assert sampling.max_tokens == 3 and sampling.stop_token_ids == (9,)
    assert len(batch.episodes) == 2 and batch.metrics["rollout/branch_episodes"] == 0


def test_limits_end_the_rollout_whatever_the_harness_does_next():
    _, rollouts, _ = play(turns=4, script="catch")  # max_turns=3: the 4th call is refused, the harness returns
    assert all(r.status is RolloutStatus.TRUNCATED_TURNS and len(r.turns) == 3 for r in rollouts)
    _, rollouts, gen = play(script="long")  # 60 prompt tokens > max_total_tokens=40
    assert all(r.status is RolloutStatus.TRUNCATED_CONTEXT and not r.turns for r in rollouts) and not gen.calls
    _, rollouts, _ = play(length=4)  # each turn cut at max_tokens_per_turn: the harness goes on
    assert all(r.status is RolloutStatus.TRUNCATED_LENGTH and len(r.turns) == 2 for r in rollouts)


def test_failures_end_only_their_rollout_with_their_status():
    _, rollouts, _ = play(fail=True, script="catch")
    assert all(r.status is RolloutStatus.ERROR_GENERATOR and "replica died" in r.error for r in rollouts)
    _, rollouts, _ = play(reward="lots")
    assert all(r.status is RolloutStatus.ERROR_PARSE and "play" in r.error for r in rollouts)
    _, rollouts, _ = play(turns=0)
    assert all(r.status is RolloutStatus.ERROR_ENV and "without calling the model" in r.error for r in rollouts)
    _, rollouts, _ = play(script="idle")
    assert all(r.status is RolloutStatus.ERROR_TIMEOUT and "between model turns" in r.error for r in rollouts)
    assert all(r.reward == CONFIG.error_reward for r in rollouts)


def test_a_call_left_running_when_play_ends_records_nothing():
    env = Harness()
    env.script = "leave"

    async def main():
        rollouts = (await Rollouter(env, Generator(delay=0.2), CONFIG).collect([{}])).groups[0].rollouts
        await asyncio.sleep(0.4)
        return rollouts, [clone.left.exception() for clone in env.clones]

    rollouts, late = asyncio.run(main())
    assert all(r.status is RolloutStatus.COMPLETED and len(r.turns) == 1 for r in rollouts)
    assert all(isinstance(e, TurnRefused) and "has ended" in str(e) for e in late) and len(late) == 2


def test_calls_made_at_once_are_turns_in_order():
    _, rollouts, gen = play(script="parallel")
    for rollout in rollouts:
        assert rollout.status is RolloutStatus.COMPLETED
        assert [t.prompt_token_ids for t in rollout.turns] == [[1, 2, 3], [1, 2, 3, 5]]
    assert sorted(c[0] for c in gen.calls) == ["g0/0/t0", "g0/0/t1", "g0/1/t0", "g0/1/t1"]
    assert len({c[2].seed for c in gen.calls}) == 4


def test_generation_time_is_not_the_harness_time():
    _, rollouts, _ = play(delay=0.8)  # each turn generates longer than step_timeout_s=0.5
    assert all(r.status is RolloutStatus.COMPLETED for r in rollouts)
