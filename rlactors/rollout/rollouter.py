"""Rollouter: G concurrent rollouts per prompt through a generate function, then advantages.

Failures stay inside the rollout that had them: an env that raises, hangs past
`step_timeout_s` or returns garbage, and a generate call that fails, each end that rollout with
an `error_*` status and `error_reward`; its siblings and the run go on. The rollout keeps what
ended it (`error`) and, when the env raised, where (`error_traceback`).
"""

from __future__ import annotations

import asyncio
import statistics
import traceback
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlactors.config import RolloutConfig
from rlactors.rollout.advantages import group_advantages, is_zero_variance
from rlactors.rollout.env import (
    EnvOutputError,
    HarnessEnv,
    OnTokens,
    TokenEnv,
    TurnRefused,
    _check_token_ids,
    check_observation,
    check_reward_scores,
    check_step_result,
    turn_reward_components,
)
from rlactors.rollout.episodes import rollout_to_episodes
from rlactors.rollout.rewards import OVERLONG, overlong_penalty
from rlactors.rollout.types import Rollout, RolloutBatch, RolloutGroup, RolloutStatus, Turn
from rlactors.types import Completion, SamplingParams

# The trainer holds advantages in fp32. A reward within half its range keeps every advantage
# finite there: |reward - group mean| <= 2 * MAX_ABS_REWARD (GRPO's are smaller still).
MAX_ABS_REWARD = 3.4028234663852886e38 / 2

# generate(prompt_token_ids, sampling, request_id, session_id); a HarnessEnv's streamed turn also
# passes on_tokens= (rlactors.run.generation.generate's), which only a generate that streams must take.
GenerateFn = Callable[..., Awaitable[Completion]]


@dataclass(frozen=True)
class PromptTooLong:
    """A dataset sample whose first prompt leaves no room to generate."""

    index: int  # in the dataset
    name: str  # its id (DatasetEnv: FILE:ROW or id_field), else "sample INDEX"
    tokens: int  # the prompt's length


def sample_name(sample: Any, index: int) -> str:
    """How a sample is named in messages: its "id" when it has one, else its index in the dataset."""
    if isinstance(sample, Mapping) and isinstance(sample.get("id"), (str, int)):
        return str(sample["id"])
    return f"sample {index}"


def prompts_too_long_line(found: Sequence[PromptTooLong], total: int, max_total_tokens: int, shown: int = 5) -> str:
    """The console line that counts and names the samples of `found` (of `total`)."""
    names = ", ".join(f"{p.name} ({p.tokens} tokens)" for p in found[:shown])
    more = f" and {len(found) - shown} more" if len(found) > shown else ""
    return (f"warning: {len(found)} of {total} train samples have a prompt of at least rollout.max_total_tokens="
            f"{max_total_tokens} tokens, which leaves no room to generate: {names}{more}. Their rollouts end "
            "truncated_context without a turn and train nothing (counted per step as rollout/prompts_too_long); "
            "raise rollout.max_total_tokens (and generator.max_model_len) or shorten those prompts")


class _RolloutEnded(Exception):
    """Ends a rollout early with a status (internal control flow)."""

    def __init__(self, status: RolloutStatus, error: str | None = None, raised: BaseException | None = None) -> None:
        super().__init__(status.value)
        self.status = status
        self.error = error
        self.traceback = format_traceback(raised) if raised is not None else None


class Rollouter:
    """Runs rollouts of `env` through `generate`.

    Ids and seeds come from counters, so they are unique across the run (and across a resume,
    via `state_dict`): group `g{n}`, session `g{n}/{i}` (sticky routing keeps a rollout's turns
    on one replica, where its prefix is cached), request `g{n}/{i}/t{k}`, and sampling seed
    `rollout.seed * max_turns + k` with `rollout.seed = (seed << 32) + rollout number`.
    """

    def __init__(self, env: TokenEnv, generate: GenerateFn, config: RolloutConfig, seed: int = 0) -> None:
        self.env = env
        self.generate = generate
        self.config = config
        self.seed = seed
        self._groups_started = 0
        self._rollouts_started = 0

    def state_dict(self) -> dict[str, int]:
        return {"groups_started": self._groups_started, "rollouts_started": self._rollouts_started}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._groups_started = state["groups_started"]
        self._rollouts_started = state["rollouts_started"]

    async def collect(self, samples: Sequence[Any]) -> RolloutBatch:
        """The groups of `samples`, run at once: their episodes, the groups, and metrics."""
        groups = await asyncio.gather(*(self.run_group(s) for s in samples))
        episodes = [ep for g in groups for ep in g.episodes]
        return RolloutBatch(episodes=episodes, groups=list(groups), metrics=summarize(groups))

    def run_group(self, sample: Any) -> Awaitable[RolloutGroup]:
        """Plays a group of `group_size` rollouts of `sample`. Its ids and seeds are taken when
        this is called, so `state_dict()` counts the group as started from then on."""
        group_id = f"g{self._groups_started}"
        self._groups_started += 1
        first = self._rollouts_started
        self._rollouts_started += self.config.group_size
        rollouts = [
            Rollout(group_id=group_id, index=i, session_id=f"{group_id}/{i}",
                    seed=(self.seed << 32) + first + i, sample=sample)
            for i in range(self.config.group_size)
        ]
        return self._play_group(group_id, sample, rollouts)

    async def _play_group(self, group_id: str, sample: Any, rollouts: list[Rollout]) -> RolloutGroup:
        await asyncio.gather(*(self.run_rollout(r) for r in rollouts))

        rewards = [r.reward for r in rollouts]
        for rollout, advantage in zip(rollouts, group_advantages(rewards, self.config.advantage)):
            rollout.advantage = advantage
        zero_variance = is_zero_variance(rewards)
        dropped = zero_variance and not self.config.keep_zero_variance_groups
        # rollout.mask_truncated: a cut rollout counts in its group's advantages but is not trained.
        trained = [r for r in rollouts
                   if not (self.config.mask_truncated and r.status is RolloutStatus.TRUNCATED_LENGTH)]
        episodes = [] if dropped else [ep for r in trained for ep in rollout_to_episodes(r)]
        return RolloutGroup(group_id=group_id, sample=sample, rollouts=rollouts,
                            zero_variance=zero_variance, dropped=dropped, episodes=episodes)

    async def run_rollout(self, rollout: Rollout, temperature: float | None = None) -> None:
        """Plays one rollout and sets its turns, status, reward components and reward. It samples
        with the rollout config's temperature, top-p and top-k, or, given `temperature` (0 is
        greedy), at that temperature with top-p and top-k off (evaluation)."""
        cfg = self.config
        try:
            env = self.env.clone()
            rollout.status = await self._play(env, rollout, temperature)
            rollout.reward_components = _turn_reward_sums(rollout)
            scores = await self._env_call(env.rubric.score(rollout), "rubric.score")
            rollout.reward_components.update(self._checked(check_reward_scores, scores, "rubric.score"))
            rollout.reward = env.rubric.total(rollout.reward_components)
            if cfg.overlong_buffer_tokens:
                penalty = overlong_penalty([len(t.token_ids) for t in rollout.turns], cfg.max_tokens_per_turn,
                                           cfg.overlong_buffer_tokens, cfg.overlong_penalty)
                rollout.reward_components[OVERLONG] = penalty
                rollout.reward += penalty
            if not abs(rollout.reward) <= MAX_ABS_REWARD:  # NaN and inf too
                raise _RolloutEnded(RolloutStatus.ERROR_PARSE, f"rubric total is {rollout.reward}, "
                                    f"not a number within +-{MAX_ABS_REWARD:.4g}")
        except _RolloutEnded as ended:
            rollout.status, rollout.error, rollout.error_traceback = ended.status, ended.error, ended.traceback
        except Exception as e:  # noqa: BLE001 - a bug in one env must not end the run
            rollout.status, rollout.error = RolloutStatus.ERROR_ENV, f"{type(e).__name__}: {e}"
            rollout.error_traceback = format_traceback(e)
        if rollout.status.is_error:
            rollout.reward = self.config.error_reward
            rollout.reward_components = _turn_reward_sums(rollout)  # what its turns earned, for the logs

    def _sampling(self, temperature: float | None, max_tokens: int, stop_token_ids: Sequence[int],
                  seed: int) -> SamplingParams:
        cfg = self.config
        top_p, top_k = (cfg.top_p, cfg.top_k) if temperature is None else (1.0, 0)
        temperature = cfg.temperature if temperature is None else temperature
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                              stop_token_ids=tuple(stop_token_ids), seed=seed)

    async def _play(self, env: TokenEnv, rollout: Rollout, temperature: float | None) -> RolloutStatus:
        if isinstance(env, HarnessEnv):
            return await self._play_harness(env, rollout, temperature)
        cfg = self.config
        obs = self._checked(check_observation, await self._env_call(env.reset(rollout.sample), "reset"), "reset")
        prompt = rollout.prompt_token_ids = obs.prompt_token_ids
        rollout.info.update(obs.info)
        for k in range(cfg.max_turns):
            room = cfg.max_total_tokens - len(prompt)
            if room < 1:
                return RolloutStatus.TRUNCATED_CONTEXT
            sampling = self._sampling(temperature, min(cfg.max_tokens_per_turn, room), env.stop_token_ids,
                                      rollout.seed * cfg.max_turns + k)
            completion = await self._generate(prompt, sampling, f"{rollout.session_id}/t{k}", rollout.session_id)
            turn = Turn(prompt_token_ids=prompt, token_ids=list(completion.token_ids),
                        logprobs=list(completion.logprobs), versions=list(completion.versions),
                        finish_reason=completion.finish_reason, routed_experts=completion.routed_experts)
            rollout.turns.append(turn)
            result = self._checked(check_step_result, await self._env_call(env.step(completion), "step"), "step")
            turn.reward = turn_reward_components(result.reward)
            turn.info = result.info
            if completion.finish_reason == "length":
                return RolloutStatus.TRUNCATED_LENGTH
            if result.done or result.status is not None:
                return result.status or RolloutStatus.COMPLETED
            prompt = result.next_token_ids
        return RolloutStatus.TRUNCATED_TURNS

    async def prompts_too_long(self, samples: Sequence[Any]) -> list[PromptTooLong]:
        """The samples whose first prompt leaves no room to generate within
        `rollout.max_total_tokens` (their rollouts would end truncated_context without a turn),
        found by `reset` on a fresh clone of the env for each; a sample whose reset fails is left
        to its rollouts, which report the failure."""
        found = []
        for i, sample in enumerate(samples):
            try:
                obs = check_observation(await self._env_call(self.env.clone().reset(sample), "reset"))
            except Exception:  # noqa: BLE001 - its rollouts will end error_* and say why
                continue
            if len(obs.prompt_token_ids) >= self.config.max_total_tokens:
                found.append(PromptTooLong(i, sample_name(sample, i), len(obs.prompt_token_ids)))
        return found

    async def _play_harness(self, env: HarnessEnv, rollout: Rollout, temperature: float | None) -> RolloutStatus:
        """Runs `env.play` while it calls the model; watches its own time between turns."""
        turns = _HarnessTurns(self, env, rollout, temperature)
        harness = asyncio.ensure_future(env.play(rollout.sample, turns))
        refused = asyncio.ensure_future(turns.refused.wait())
        loop = asyncio.get_running_loop()
        timeout = self.config.step_timeout_s
        try:
            while not (harness.done() or refused.done()):
                idle = 0.0 if turns.generating else loop.time() - turns.idle_since
                if idle >= timeout:
                    raise _RolloutEnded(RolloutStatus.ERROR_TIMEOUT,
                                        f"env play ran past step_timeout_s={timeout} between model turns")
                await asyncio.wait({harness, refused}, timeout=timeout - idle, return_when=asyncio.FIRST_COMPLETED)
        finally:
            turns.closed = True
            refused.cancel()
            if not harness.done():
                harness.cancel()
                await asyncio.wait({harness}, timeout=timeout)
        error = harness.exception() if harness.done() and not harness.cancelled() else None
        if turns.ended is not None:  # a limit or the generator ended the rollout, whatever play did next
            if turns.ended.status.is_error:
                raise _RolloutEnded(turns.ended.status, str(turns.ended))
            return turns.ended.status
        if error is not None:
            raise _RolloutEnded(RolloutStatus.ERROR_ENV, f"env play raised {type(error).__name__}: {error}", error)
        if not rollout.turns:
            raise _RolloutEnded(RolloutStatus.ERROR_ENV, "env play returned without calling the model")
        rollout.turns[-1].reward = self._checked(turn_reward_components, harness.result(), "play")
        if any(t.finish_reason == "length" for t in rollout.turns):
            return RolloutStatus.TRUNCATED_LENGTH
        return RolloutStatus.COMPLETED

    async def _generate(self, prompt: list[int], sampling: SamplingParams, request_id: str,
                        session_id: str, on_tokens: OnTokens | None = None) -> Completion:
        try:
            if on_tokens is None:
                completion = await self.generate(prompt, sampling, request_id, session_id)
            else:
                completion = await self.generate(prompt, sampling, request_id, session_id, on_tokens=on_tokens)
        except Exception as e:  # noqa: BLE001 - the generator side failed, not this rollout's env
            raise _RolloutEnded(RolloutStatus.ERROR_GENERATOR, f"{type(e).__name__}: {e}") from e
        if completion.finish_reason in ("error", "abort"):
            raise _RolloutEnded(RolloutStatus.ERROR_GENERATOR,
                                completion.error or f"finish_reason={completion.finish_reason}")
        return completion

    async def _env_call(self, call: Awaitable[Any], what: str) -> Any:
        try:
            return await asyncio.wait_for(call, self.config.step_timeout_s)
        except TimeoutError as e:
            raise _RolloutEnded(RolloutStatus.ERROR_TIMEOUT,
                                f"env {what} ran past step_timeout_s={self.config.step_timeout_s}") from e
        except EnvOutputError as e:  # a MessageEnv's start/respond returned the wrong type
            raise _RolloutEnded(RolloutStatus.ERROR_PARSE, f"env {what}: {e}") from e
        except Exception as e:  # noqa: BLE001 - user env code
            raise _RolloutEnded(RolloutStatus.ERROR_ENV, f"env {what} raised {type(e).__name__}: {e}", e) from e

    @staticmethod
    def _checked(check: Callable[[Any], Any], value: Any, what: str) -> Any:
        try:
            return check(value)
        except ValueError as e:
            raise _RolloutEnded(RolloutStatus.ERROR_PARSE, f"env {what}: {e}") from e


class _HarnessTurns:
    """The `model` a HarnessEnv's play calls: one turn of its rollout per call, under the rollout's
    limits, ids and seeds (those of TokenEnv turns). Records each turn, and when the rollout must
    end (`ended`), refuses every later call and sets `refused`; once play has ended (`closed`), a
    call still running records nothing."""

    def __init__(self, rollouter: Rollouter, env: HarnessEnv, rollout: Rollout, temperature: float | None) -> None:
        self.rollouter, self.env, self.rollout, self.temperature = rollouter, env, rollout, temperature
        self.ended: TurnRefused | None = None
        self.closed = False  # play has ended: a call still in flight (a cancelled harness's) records nothing
        self.refused = asyncio.Event()
        self.one_at_a_time = asyncio.Lock()
        self.generating = 0
        self.idle_since = asyncio.get_running_loop().time()

    async def __call__(self, prompt_token_ids: list[int], max_tokens: int | None = None,
                       stop_token_ids: Sequence[int] = (), on_tokens: OnTokens | None = None) -> Turn:
        async with self.one_at_a_time:  # turn k's id and seed are taken from the turns recorded before it
            return await self._turn(prompt_token_ids, max_tokens, stop_token_ids, on_tokens)

    async def _turn(self, prompt_token_ids: list[int], max_tokens: int | None, stop_token_ids: Sequence[int],
                    on_tokens: OnTokens | None) -> Turn:
        cfg, rollout = self.rollouter.config, self.rollout
        if self.ended is not None:
            raise self.ended
        if self.closed:
            raise TurnRefused(rollout.status, "the rollout has ended")
        _check_token_ids(prompt_token_ids, "prompt_token_ids")
        k = len(rollout.turns)
        room = cfg.max_total_tokens - len(prompt_token_ids)
        if k == cfg.max_turns:
            self._end(RolloutStatus.TRUNCATED_TURNS, f"the rollout has had its rollout.max_turns={cfg.max_turns} turns")
        if room < 1:
            self._end(RolloutStatus.TRUNCATED_CONTEXT, f"the prompt's {len(prompt_token_ids)} tokens leave no room "
                      f"to generate within rollout.max_total_tokens={cfg.max_total_tokens}")
        limit = min(cfg.max_tokens_per_turn, room, max_tokens or cfg.max_tokens_per_turn)
        sampling = self.rollouter._sampling(self.temperature, limit, (*self.env.stop_token_ids, *stop_token_ids),
                                            rollout.seed * cfg.max_turns + k)
        self.generating += 1
        try:
            completion = await self.rollouter._generate(list(prompt_token_ids), sampling,
                                                        f"{rollout.session_id}/t{k}", rollout.session_id, on_tokens)
        except _RolloutEnded as e:
            self._end(e.status, e.error or e.status.value)
        finally:
            self.generating -= 1
            self.idle_since = asyncio.get_running_loop().time()
        if self.closed:
            raise TurnRefused(rollout.status, "the rollout has ended")
        turn = Turn(prompt_token_ids=list(prompt_token_ids), token_ids=list(completion.token_ids),
                    logprobs=list(completion.logprobs), versions=list(completion.versions),
                    finish_reason=completion.finish_reason)
        rollout.turns.append(turn)
        return turn

    def _end(self, status: RolloutStatus, message: str) -> None:
        self.ended = TurnRefused(status, message)
        self.refused.set()
        raise self.ended


_ASYNCIO_DIR = Path(asyncio.__file__).parent


def format_traceback(error: BaseException) -> str:
    """The exception's traceback as Python prints it, from the env's side on: the leading frames
    of this module and asyncio, which awaited the env, are left out."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None and _awaits_the_env(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(error), error, tb)).rstrip("\n")


def _awaits_the_env(filename: str) -> bool:
    return filename == __file__ or Path(filename).parent == _ASYNCIO_DIR


def _turn_reward_sums(rollout: Rollout) -> dict[str, float]:
    sums: dict[str, float] = {}
    for turn in rollout.turns:
        for name, value in turn.reward.items():
            sums[name] = sums.get(name, 0.0) + value
    return sums


def group_number(group: RolloutGroup) -> int:
    """The order in which groups were started (their ids are `g{n}`)."""
    return int(group.group_id[1:])


def summarize(groups: Sequence[RolloutGroup]) -> dict[str, float]:
    """Step metrics over finished groups: statuses, dropped groups, rewards, turns, lengths."""
    rollouts = [r for g in groups for r in g.rollouts]
    episodes = [ep for g in groups for ep in g.episodes]
    statuses = Counter(r.status for r in rollouts)
    metrics = {
        "rollout/groups": float(len(groups)),
        "rollout/groups_zero_variance": float(sum(g.zero_variance for g in groups)),
        "rollout/groups_dropped": float(sum(g.dropped for g in groups)),
        "rollout/rollouts": float(len(rollouts)),
        "rollout/episodes": float(len(episodes)),
        "rollout/branch_episodes": float(sum(ep.branch > 0 for ep in episodes)),
        # Records whose prompt alone fills rollout.max_total_tokens: their rollouts train nothing.
        "rollout/prompts_too_long": float(sum(any(r.prompt_too_long for r in g.rollouts) for g in groups)),
    }
    metrics.update({f"rollout/status/{s.value}": float(statuses[s]) for s in RolloutStatus})
    if rollouts:
        rewards = [r.reward for r in rollouts]
        metrics.update({
            "rollout/reward_mean": statistics.fmean(rewards),
            "rollout/reward_std": statistics.pstdev(rewards),
            "rollout/reward_min": min(rewards),
            "rollout/reward_max": max(rewards),
            # The middle half of the rollouts' rewards (the reward curve's band).
            "rollout/reward_p25": _quartiles(rewards)[0],
            "rollout/reward_p75": _quartiles(rewards)[1],
            "rollout/turns_mean": statistics.fmean(len(r.turns) for r in rollouts),
            "rollout/generated_tokens_mean": statistics.fmean(r.num_generated_tokens for r in rollouts),
        })
        for name in sorted({n for r in rollouts for n in r.reward_components}):
            values = [r.reward_components[name] for r in rollouts if name in r.reward_components]
            metrics[f"rollout/reward/{name}_mean"] = statistics.fmean(values)
    if episodes:
        metrics["rollout/episode_tokens_mean"] = statistics.fmean(len(ep) for ep in episodes)
        metrics["rollout/episode_tokens_max"] = float(max(len(ep) for ep in episodes))
    return metrics


def _quartiles(values: Sequence[float]) -> tuple[float, float]:
    """The 25th and 75th percentiles, interpolated between the sorted values."""
    if len(values) == 1:
        return values[0], values[0]
    low, _, high = statistics.quantiles(values, n=4, method="inclusive")
    return low, high
