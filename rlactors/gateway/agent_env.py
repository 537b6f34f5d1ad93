"""AgentEnv: an env whose rollouts are agent harnesses talking to the gateway."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from rlactors.config import ConfigError, GatewayConfig
from rlactors.gateway.server import Gateway
from rlactors.rollout.env import HarnessEnv, ModelTurns, TokenEnv


class AgentEnv(HarnessEnv):
    """Subclass this and implement `async def run(self, sample, client) -> reward`.

    `client` is an `openai.AsyncOpenAI` pointed at this rollout's gateway session; every chat
    completion it makes is one turn of the rollout, whatever loop (tool calls, retries of your
    own) the harness runs around it. Harnesses that build their own client (LangChain, the OpenAI
    Agents SDK, a subprocess) read `self.base_url` and `self.api_key` instead, and may set
    `openai_client = False`: `run` then gets None, and no client is built per rollout. Return the reward,
    a number or named components; raising ends the rollout `error_env`, and hanging past
    `rollout.step_timeout_s` between model calls ends it `error_timeout`. The controller starts the
    gateway and sets `gateway` before the first rollout.
    """

    openai_client: ClassVar[bool] = True

    def __init__(self, config: Any = None, tokenizer: Any = None) -> None:
        super().__init__(config, tokenizer)
        if tokenizer is None or tokenizer.eos_token_id is None:
            raise ValueError(f"{type(self).__name__} is an AgentEnv and needs a tokenizer with an eos_token")
        if not tokenizer.chat_template:
            raise ConfigError(f"model.path: the tokenizer of {tokenizer.name_or_path!r} has no chat template; "
                              f"{type(self).__name__} is an AgentEnv and its gateway renders chats with it")
        self.stop_token_ids = (tokenizer.eos_token_id,)
        self.gateway: Any = None  # a started rlactors.gateway.Gateway
        self.base_url: str | None = None
        self.api_key: str | None = None

    def clone(self) -> AgentEnv:
        env = super().clone()
        env.gateway = self.gateway
        return env

    async def run(self, sample: Any, client: Any) -> float | Mapping[str, float]:
        raise NotImplementedError

    async def play(self, sample: Any, model: ModelTurns) -> float | Mapping[str, float]:
        if self.gateway is None:
            raise RuntimeError(f"{type(self).__name__} has no gateway: the controller starts one for an AgentEnv "
                               "(rlactors.gateway.Gateway; set env.gateway when driving a Rollouter yourself)")
        async with self.gateway.session(model) as session:
            self.base_url, self.api_key = session.base_url, session.api_key
            if not self.openai_client:
                return await self.run(sample, None)
            async with self.gateway.client(session) as client:
                return await self.run(sample, client)


async def serve_agent_env(env: TokenEnv, config: GatewayConfig, max_tokens: int, tokenizer: Any) -> Gateway | None:
    """For an AgentEnv, a started gateway (bounded by `config` and `max_tokens`, the rollout's
    max_tokens_per_turn), set as `env.gateway`; None for any other env. The caller stops it."""
    if not isinstance(env, AgentEnv):
        return None
    gateway = Gateway(config, tokenizer, max_tokens)
    await gateway.start()
    env.gateway = gateway
    return gateway
