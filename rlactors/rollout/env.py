"""The env API users write against: TokenEnv (token in, token out) and MessageEnv (chat).

An env instance plays ONE rollout at a time: the Rollouter calls `clone()` for each rollout and
then `reset(sample)` once and `step(completion)` once per turn. Keep per-rollout state on `self`.
"""

from __future__ import annotations

import importlib
import inspect
import os
import random
import sys
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rlactors.config import ConfigError, EnvConfig, build_dataclass
from rlactors.models.tokenizer import extend_with_messages, render_messages
from rlactors.rollout.types import Observation, Rollout, RolloutStatus, StepResult, Turn
from rlactors.types import Completion, TokenDelta

TURN_REWARD = "reward"  # the component name of a per-turn reward given as a plain number


@dataclass(frozen=True)
class RewardFunc:
    """A named per-rollout reward: `fn(rollout) -> float` (or an awaitable of one), weighted."""

    name: str
    fn: Callable[[Rollout], float | Awaitable[float]]
    weight: float = 1.0


class Rubric:
    """How an env's rewards add up to the one number advantages are computed from.

    Rewards come from two places: per turn (`StepResult.reward`, a number or named components)
    and per rollout (the rubric's `RewardFunc`s, run once the rollout has ended). The total is
    the weighted sum of all components, where per-turn components are summed over turns and
    weighted by `weights[name]` (1.0 when not given).
    """

    def __init__(self, funcs: Sequence[RewardFunc] = (), weights: Mapping[str, float] | None = None) -> None:
        self.funcs = list(funcs)
        self.weights = dict(weights or {})
        names = [f.name for f in self.funcs]
        clashes = sorted({n for n in names if names.count(n) > 1 or n in self.weights})
        if clashes:
            raise ValueError(f"reward names must be unique across funcs and weights, repeated: {clashes}")
        self.weights.update({f.name: f.weight for f in self.funcs})

    async def score(self, rollout: Rollout) -> dict[str, float]:
        scores = {}
        for f in self.funcs:
            value = f.fn(rollout)
            if inspect.isawaitable(value):
                value = await value
            scores[f.name] = value
        return scores

    def total(self, components: Mapping[str, float]) -> float:
        return sum(self.weights.get(name, 1.0) * value for name, value in components.items())


class TokenEnv:
    """Subclass this. Declare a `Config` dataclass for your knobs; `load_env` builds it from args.

    - `dataset(split)`: the samples of a split ("train", "eval"), deterministic given the config.
    - `reset(sample) -> Observation`: the first prompt as token ids.
    - `step(completion) -> StepResult`: score the turn; return the next prompt, which should
      extend the previous prompt + `completion.token_ids` (append your tokens; never re-tokenize
      the history), or `done=True`.
    - `stop_token_ids`: tokens that end a turn (added to the sampling params).
    - `rubric`: weights of named per-turn rewards and per-rollout reward functions.
    """

    @dataclass
    class Config:
        pass

    def __init__(self, config: Any = None, tokenizer: Any = None) -> None:
        self.config = config if config is not None else self.Config()
        self.tokenizer = tokenizer
        self.rubric = Rubric()
        self.stop_token_ids: tuple[int, ...] = ()

    def clone(self) -> TokenEnv:
        """A fresh env for one rollout. Override to share expensive read-only state."""
        return type(self)(self.config, self.tokenizer)

    def dataset(self, split: str) -> Sequence[Any]:
        raise NotImplementedError(f"{type(self).__name__} does not define dataset()")

    async def reset(self, sample: Any) -> Observation:
        raise NotImplementedError

    async def step(self, completion: Completion) -> StepResult:
        raise NotImplementedError


class EnvOutputError(ValueError):
    """An env returned a value of the wrong type or shape: the rollout ends `error_parse`, with
    what was expected."""


@dataclass
class MessageStep:
    """What `MessageEnv.respond` returns: the next messages to append (None when done)."""

    messages: list[dict[str, str]] | None
    reward: float | Mapping[str, float] = 0.0
    done: bool = False
    status: RolloutStatus | None = None
    info: dict[str, Any] = field(default_factory=dict)


class MessageEnv(TokenEnv):
    """A TokenEnv that speaks chat messages; the tokenizer's chat template renders them.

    Implement `start(sample) -> messages` and `respond(reply_text, completion) -> MessageStep`.
    The first prompt is the rendered conversation; each later prompt is the previous prompt +
    the completion's exact tokens + the rendering of the new messages only
    (`extend_with_messages`), so the model's tokens are never decoded and re-encoded.

    End of turn: generation stops on the tokenizer's EOS (ChatML: `<|im_end|>`), which the
    completion includes, so the model is trained to end its turn. The template closes an
    assistant turn with more than that token (ChatML: `<|im_end|>\n`); `extend_with_messages`
    adds whatever part of that closing the completion does not already end with: the `\n` after
    a stopped turn, the whole `<|im_end|>\n` after a turn cut by the length limit. These are
    env tokens (not trained), and the next user message starts a well-formed turn.

    `tools` (OpenAI-style function specs, set in `__init__` or `start`) are rendered by the chat
    template with the conversation.
    """

    def __init__(self, config: Any = None, tokenizer: Any = None) -> None:
        super().__init__(config, tokenizer)
        if tokenizer is None:
            raise ValueError(f"{type(self).__name__} is a MessageEnv and needs a tokenizer")
        if tokenizer.eos_token_id is None:
            raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no eos_token to end a turn with")
        if not tokenizer.chat_template:
            # Fail here, not in every rollout's reset (each would end error_env and the run train on nothing).
            raise ConfigError(f"model.path: the tokenizer of {tokenizer.name_or_path!r} has no chat template; "
                              f"{type(self).__name__} is a MessageEnv and renders its messages with it")
        self.stop_token_ids = (tokenizer.eos_token_id,)
        self.tools: list[dict[str, Any]] | None = None
        self._prompt_ids: list[int] = []

    async def start(self, sample: Any) -> list[dict[str, str]]:
        raise NotImplementedError

    async def respond(self, reply: str, completion: Completion) -> MessageStep:
        raise NotImplementedError

    async def reset(self, sample: Any) -> Observation:
        messages = _check_messages(await self.start(sample), "start")
        self._prompt_ids = render_messages(self.tokenizer, messages, add_generation_prompt=True, tools=self.tools)
        return Observation(prompt_token_ids=self._prompt_ids)

    async def step(self, completion: Completion) -> StepResult:
        reply = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        result = await self.respond(reply, completion)
        if not isinstance(result, MessageStep):
            raise EnvOutputError(f"respond must return a MessageStep, got {_described(result)}")
        if not isinstance(result.done, bool):
            raise EnvOutputError(f"MessageStep.done must be a bool, got {result.done!r}")
        if result.messages is not None:
            _check_messages(result.messages, "MessageStep.messages")
        if result.done or result.messages is None:
            return StepResult(None, result.reward, done=True, status=result.status, info=result.info)
        self._prompt_ids = extend_with_messages(
            self.tokenizer, self._prompt_ids + list(completion.token_ids), result.messages,
            add_generation_prompt=True, tools=self.tools)
        return StepResult(self._prompt_ids, result.reward, done=False, status=result.status, info=result.info)


def _check_messages(messages: Any, what: str) -> list[dict[str, str]]:
    ok = isinstance(messages, list) and bool(messages) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages)
    if not ok:
        raise EnvOutputError(f"{what} must return a non-empty list of {{'role': str, 'content': str}} messages, "
                             f"got {_described(messages)}")
    return messages


def _described(value: Any) -> str:
    """The type and a short repr of a wrong value, for error lines."""
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 80 else text[:77] + '...'}"


# Awaited with each TokenDelta of a streamed turn as the tokens are sampled: together exactly the turn's tokens.
OnTokens = Callable[[TokenDelta], Awaitable[None]]


class ModelTurns(Protocol):
    """What a HarnessEnv calls once per model turn of its rollout (the Rollouter provides it)."""

    async def __call__(self, prompt_token_ids: list[int], max_tokens: int | None = None,
                       stop_token_ids: Sequence[int] = (), on_tokens: OnTokens | None = None) -> Turn: ...


class TurnRefused(Exception):
    """The rollout takes no more turns: a limit was reached (`status` truncated_*) or the generator
    failed (`status` error_generator). The rollout ends with `status`."""

    def __init__(self, status: RolloutStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


class HarnessEnv(TokenEnv):
    """An env whose own code drives the conversation, as an agent harness does: implement
    `play(sample, model)`, which calls `await model(prompt_token_ids)` once per turn and returns
    the rollout's reward (a number or named components).

    `model(prompt, max_tokens=None, stop_token_ids=(), on_tokens=None)` samples one completion
    (awaiting `on_tokens` with its tokens as they are sampled, when given) under the rollout's
    limits, seeds and ids, records it as the rollout's next turn and returns that `Turn`; past a
    limit (max_turns, max_total_tokens) or when the generator fails it raises `TurnRefused`, and
    the rollout ends with that status whatever `play` does next. Calls made at once run one after
    another, in turn order. A prompt that does not extend the
    previous prompt + completion starts a new branch episode, as with TokenEnv. `step_timeout_s`
    bounds the harness's own time between turns (and before the first); a turn cut by its token
    limit is returned to the harness, and the rollout ends `truncated_length` once `play` returns.
    The reward `play` returns is recorded as its last turn's reward; the rubric adds to it.
    """

    async def play(self, sample: Any, model: ModelTurns) -> float | Mapping[str, float]:
        raise NotImplementedError


def load_env(env_config: EnvConfig, tokenizer: Any = None) -> TokenEnv:
    """Imports `module:Class` (from the working directory too) and builds it with its Config
    from `env_config.args`."""
    module_name, _, class_name = env_config.name.partition(":")
    if not module_name or not class_name:
        raise ConfigError(f"env.name must be 'module:Class', got {env_config.name!r}")
    module = _import_env_module(module_name)
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ConfigError(f"env.name: module {module_name!r} ({module.__file__}) has no {class_name!r}")
    if not (isinstance(cls, type) and issubclass(cls, TokenEnv)):
        raise ConfigError(f"env.name: {env_config.name!r} is not a TokenEnv subclass")
    config = build_dataclass(cls.Config, dict(env_config.args), "env.args")
    return cls(config, tokenizer)


def _import_env_module(name: str) -> Any:
    """Imports `name`, looking in the working directory after sys.path: a user's env module next
    to where they start the run is found without PYTHONPATH, and never shadows an installed one."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
        importlib.invalidate_caches()
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
            raise ConfigError(f"env.name: no module named {e.name!r} (looked in the working directory {cwd} "
                              "and on sys.path)") from None
        raise ConfigError(f"env.name: module {name!r} cannot be imported: {e}") from e
    except ImportError as e:
        raise ConfigError(f"env.name: module {name!r} cannot be imported: {e}") from e


class SampleStream:
    """Endless passes over a dataset, reshuffled each epoch from a seed; resumable.

    The order depends only on (seed, epoch), so `state_dict()` (epoch and position) is all a
    checkpoint needs to continue with exactly the samples that would have come next.
    """

    def __init__(self, samples: Sequence[Any], seed: int) -> None:
        if len(samples) == 0:
            raise ValueError("SampleStream needs a non-empty dataset")
        self.samples = samples
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order()

    def _epoch_order(self) -> list[int]:
        order = list(range(len(self.samples)))
        random.Random(f"{self.seed}:{self.epoch}").shuffle(order)
        return order

    def next(self, n: int) -> list[Any]:
        batch = []
        for _ in range(n):
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._epoch_order()
            batch.append(self.samples[self._order[self.position]])
            self.position += 1
        return batch

    def __iter__(self) -> Iterator[Any]:
        """One sample at a time, forever."""
        while True:
            yield from self.next(1)

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"SampleStream state has seed {state['seed']}, this stream uses {self.seed}")
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._epoch_order()


def check_observation(obs: Any) -> Observation:
    """Raises ValueError unless `obs` is a usable Observation."""
    if not isinstance(obs, Observation):
        raise ValueError(f"reset must return an Observation, got {type(obs).__name__}")
    _check_token_ids(obs.prompt_token_ids, "Observation.prompt_token_ids")
    return obs


def check_step_result(result: Any) -> StepResult:
    """Raises ValueError unless `result` is a usable StepResult."""
    if not isinstance(result, StepResult):
        raise ValueError(f"step must return a StepResult, got {type(result).__name__}")
    if not isinstance(result.done, bool):
        raise ValueError(f"StepResult.done must be a bool, got {result.done!r}")
    if result.status is not None and not isinstance(result.status, RolloutStatus):
        raise ValueError(f"StepResult.status must be a RolloutStatus or None, got {result.status!r}")
    if result.next_token_ids is None:
        if not result.done:
            raise ValueError("StepResult.next_token_ids is None but done is False")
    else:
        _check_token_ids(result.next_token_ids, "StepResult.next_token_ids")
    turn_reward_components(result.reward)
    return result


def turn_reward_components(reward: Any) -> dict[str, float]:
    """A per-turn reward as named components; a plain number is named TURN_REWARD."""
    components = reward if isinstance(reward, Mapping) else {TURN_REWARD: reward}
    for name, value in components.items():
        if not isinstance(name, str) or not _is_finite_number(value):
            raise ValueError(f"reward components must be str -> finite number, got {name!r}: {value!r}")
    return {name: float(value) for name, value in components.items()}


def check_reward_scores(scores: Any) -> dict[str, float]:
    if not isinstance(scores, Mapping):
        raise ValueError(f"rubric scores must be a mapping, got {type(scores).__name__}")
    return turn_reward_components(scores)


def _is_finite_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and abs(x) != float("inf")


def _check_token_ids(ids: Any, what: str) -> None:
    if not isinstance(ids, list) or not ids:
        raise ValueError(f"{what} must be a non-empty list of token ids, got {type(ids).__name__}")
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ValueError(f"{what} must hold non-negative ints")

