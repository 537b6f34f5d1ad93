"""Evaluation on an env's held-out split, for any env: `eval.samples` samples of
`env.dataset("eval")`, `eval.samples_per_prompt` rollouts each, greedy by default, through a
generate function (the router, in training and in `python -m rlactors.evaluate`).

The Rollouter plays the rollouts, so env calls, turn and token limits, the over-long penalty and
error statuses are those of training. Seeds and ids are fixed per eval sample and rollout, not
drawn from training's counters: evals at different steps score the same samples with the same
seeds (comparable), and training's seeds and sample order are the same with evaluation on or off.
Ids are `eval{step}-{i}/{j}` (sample i, rollout j) and `.../t{k}` per turn; training's are `g{n}/...`.

In training, `EvalSchedule` says when: the policy of step 0, of every `controller.eval_every`-th
step and of the last step, in sync mode before the next step's update, in async mode beside
training.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from rlactors.config import Config, ConfigError, ControllerConfig, EvalConfig, RolloutConfig
from rlactors.rollout.env import TokenEnv
from rlactors.rollout.rollouter import GenerateFn, Rollouter
from rlactors.rollout.types import Rollout, RolloutStatus
from rlactors.run.run_dir import TrainingError

EVAL_SPLIT = "eval"
PREFIX = "eval/"


def eval_due(step: int, eval_every: int, total_steps: int) -> bool:
    """Whether the policy of `step` is evaluated: at step 0 (before training), every
    `eval_every` steps and at the last step; never when `eval_every` is 0."""
    return eval_every > 0 and (step % eval_every == 0 or step == total_steps)


def eval_samples(env: TokenEnv, env_name: str, config: EvalConfig) -> list[Any]:
    """The first `config.samples` samples of the env's eval split (all of it for 0).

    Raises ConfigError in one line when the env has no eval split, it is empty, or it is smaller
    than `config.samples`."""
    try:
        samples = env.dataset(EVAL_SPLIT)
    except (NotImplementedError, ValueError, KeyError) as e:  # ConfigError is a ValueError
        raise ConfigError(f"env {env_name} has no eval split: dataset({EVAL_SPLIT!r}) raised "
                          f"{type(e).__name__}: {e}") from None
    if len(samples) == 0:
        raise ConfigError(f"env {env_name}: the eval split is empty")
    if config.samples > len(samples):
        raise ConfigError(f"eval.samples: {config.samples} asked for, but the eval split of env {env_name} "
                          f"has {len(samples)} samples (0 = all of them)")
    return list(samples[:config.samples or len(samples)])


class Evaluator:
    """Scores a policy on fixed eval samples. `await evaluate(step, policy_version)` returns the
    `eval/*` metrics of one evaluation."""

    def __init__(self, env: TokenEnv, generate: GenerateFn, rollout_config: RolloutConfig, config: EvalConfig,
                 samples: Sequence[Any]) -> None:
        config.validate("eval")
        self.config = config
        self.samples = list(samples)
        self._rollouter = Rollouter(env, generate, rollout_config)

    @property
    def num_rollouts(self) -> int:
        return len(self.samples) * self.config.samples_per_prompt

    async def evaluate(self, step: int, policy_version: int,
                       on_rollout: Callable[[Rollout], None] | None = None) -> dict[str, float]:
        """Plays every eval rollout at once (the generators batch them) and summarizes them.

        `step` names the eval's ids; `policy_version` is the version the generators held when it
        started; `on_rollout` is called as each rollout finishes (progress)."""
        k = self.config.samples_per_prompt
        start = time.perf_counter()
        groups = [[Rollout(group_id=f"eval{step}-{i}", index=j, session_id=f"eval{step}-{i}/{j}", seed=i * k + j,
                           sample=sample) for j in range(k)]
                  for i, sample in enumerate(self.samples)]

        async def play(rollout: Rollout) -> None:
            await self._rollouter.run_rollout(rollout, temperature=self.config.temperature)
            if on_rollout is not None:
                on_rollout(rollout)

        await asyncio.gather(*(play(r) for group in groups for r in group))
        metrics = summarize_eval(groups, self.config.pass_reward)
        metrics[PREFIX + "policy_version"] = float(policy_version)
        versions = [v for group in groups for r in group for turn in r.turns for v in turn.versions if v >= 0]
        metrics[PREFIX + "policy_version_max"] = float(max(versions, default=policy_version))
        metrics[PREFIX + "time_s"] = time.perf_counter() - start
        return metrics


def training_evaluator(env: TokenEnv, config: Config, generate: GenerateFn) -> Evaluator | None:
    """The Evaluator of a training run (None without controller.eval_every); an eval split that
    cannot serve is a ConfigError naming controller.eval_every."""
    every = config.controller.eval_every
    if not every:
        return None
    try:
        held_out = eval_samples(env, config.env.name, config.eval)
    except ConfigError as e:
        raise ConfigError(f"controller.eval_every={every}: {e}") from None
    return Evaluator(env, generate, config.rollout, config.eval, held_out)


class EvalSchedule:
    """Training's evaluations: `after_step(step)` evaluates the policy of `step`, which the
    generators hold (`policy_version()`, read as the eval starts), when `eval_due` says so, and
    logs its record with `log`. Sync mode waits for
    it there, before the next step's update, so every eval request runs on that policy (the next
    step's rollouts may be generated meanwhile); async mode lets it run beside training, which does
    not wait for it. A failed evaluation stops the run (TrainingError)."""

    def __init__(self, evaluator: Evaluator | None, config: ControllerConfig,
                 log: Callable[[int, dict[str, float]], None], policy_version: Callable[[], int]) -> None:
        self.evaluator = evaluator
        self.config = config
        self.log = log
        self.policy_version = policy_version
        self._running: dict[int, asyncio.Task] = {}  # async mode: evals running beside training

    async def after_step(self, step: int) -> None:
        c = self.config
        if self.evaluator is None or not eval_due(step, c.eval_every, c.steps):
            return
        task = asyncio.ensure_future(self._evaluate(step))
        if c.mode == "async":
            self._running[step] = task
            return
        try:
            await task
        except Exception as e:  # noqa: BLE001 - reported as the run's error
            raise TrainingError(f"evaluation of step {step} failed: {e!r}") from e

    async def _evaluate(self, step: int) -> None:
        self.log(step, await self.evaluator.evaluate(step, self.policy_version()))

    def raise_failed(self) -> None:
        """Async mode: forgets the evals that finished, and stops the run if one failed."""
        for step, task in list(self._running.items()):
            if task.done():
                del self._running[step]
                if task.exception() is not None:
                    raise TrainingError(f"evaluation of step {step} failed: {task.exception()!r}") from task.exception()

    async def finish(self) -> None:
        """Async mode, after the last step: waits for the evals still running (the last step's)."""
        await asyncio.gather(*self._running.values(), return_exceptions=True)
        self.raise_failed()

    def cancel(self) -> None:
        for task in self._running.values():
            task.cancel()


def summarize_eval(groups: Sequence[Sequence[Rollout]], pass_reward: float) -> dict[str, float]:
    """`eval/*` metrics of finished rollouts, one list per sample (its k rollouts): reward mean
    (mean@k) and std, pass@1 (the share of rollouts whose reward is at least `pass_reward`), and
    for k > 1 pass@k (the share of samples with a passing rollout) and best@k (the mean over
    samples of their best reward); statuses, reward components, turns and generated tokens."""
    rollouts = [r for group in groups for r in group]
    rewards = [r.reward for r in rollouts]
    passed = [r.reward >= pass_reward for r in rollouts]
    statuses = Counter(r.status for r in rollouts)
    tokens = [r.num_generated_tokens for r in rollouts]
    metrics = {
        "samples": float(len(groups)),
        "rollouts": float(len(rollouts)),
        "reward_mean": statistics.fmean(rewards),
        "reward_std": statistics.pstdev(rewards),
        "pass@1": statistics.fmean(passed),
        "turns_mean": statistics.fmean(len(r.turns) for r in rollouts),
        "generated_tokens": float(sum(tokens)),
        "generated_tokens_mean": statistics.fmean(tokens),
    }
    k = len(groups[0])
    if k > 1:
        metrics[f"pass@{k}"] = statistics.fmean(any(r.reward >= pass_reward for r in group) for group in groups)
        metrics[f"best@{k}"] = statistics.fmean(max(r.reward for r in group) for group in groups)
    metrics.update({f"status/{s.value}": float(statuses[s]) for s in RolloutStatus})
    for name in sorted({n for r in rollouts for n in r.reward_components}):
        metrics[f"reward/{name}_mean"] = statistics.fmean(r.reward_components[name] for r in rollouts
                                                          if name in r.reward_components)
    return {PREFIX + key: value for key, value in metrics.items()}
