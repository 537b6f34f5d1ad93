"""Generator: one replica's Monarch actor, a thin shell over an AsyncEngine.

Every endpoint is a `@concurrent_endpoint`, so hundreds of `generate` calls are in flight at once
while one background loop steps the engine (continuous batching); a weight update or a stats call
never waits behind them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from monarch.actor import Actor, Port, concurrent_endpoint

from rlactors.config import GeneratorConfig, ModelConfig
from rlactors.engines import create_engine
from rlactors.engines.async_engine import AsyncEngine
from rlactors.procs.placement import host_name
from rlactors.types import Completion, SamplingParams


class Generator(Actor):
    """Serves `generate` on one engine built from a GeneratorConfig and a ModelConfig."""

    def __init__(self, generator_config: GeneratorConfig, model_config: ModelConfig, replica: int = 0,
                 kv_cache_bytes: int | None = None):
        self.replica = replica
        self.engine = AsyncEngine(create_engine(generator_config, model_config, kv_cache_bytes),
                                  default_update_mode=generator_config.update_mode)

    @concurrent_endpoint
    async def generate(self, prompt_token_ids: Sequence[int], sampling: SamplingParams | Mapping[str, Any],
                       request_id: str, session_id: str | None = None) -> Completion:
        # session_id only matters to the router (sticky routing); the engine's prefix cache does the rest.
        completion = await self.engine.generate(prompt_token_ids, sampling, request_id)
        completion.replica = self.replica
        return completion

    @concurrent_endpoint
    async def generate_streamed(self, prompt_token_ids: Sequence[int], sampling: SamplingParams | Mapping[str, Any],
                                request_id: str, tokens: Port, session_id: str | None = None) -> Completion:
        """`generate`, sending each engine step's new tokens (a TokenDelta) to `tokens` as they
        are sampled; the completion holds them all."""
        completion = await self.engine.generate(prompt_token_ids, sampling, request_id, tokens.send)
        completion.replica = self.replica
        return completion

    @concurrent_endpoint
    async def update_weights(self, version: int, named_tensors: Mapping[str, torch.Tensor],
                             checksum: str | None = None, mode: str | None = None) -> dict[str, Any]:
        return await self.engine.updates.update_weights(version, named_tensors, checksum, mode)

    @concurrent_endpoint
    async def join_weight_group(self, host: str, port: int, rank_offset: int, world_size: int,
                                layout: Any) -> list[int]:
        return await self.engine.updates.join_weight_group(host, port, rank_offset, world_size, layout)

    @concurrent_endpoint
    async def receive_weights(self, version: int, mode: str | None = None) -> dict[str, Any]:
        return await self.engine.updates.receive_weights(version, mode)

    @concurrent_endpoint
    async def load_shared_weights(self, handle: Any, version: int, checksum: str,
                                  mode: str | None = None) -> dict[str, Any]:
        return await self.engine.updates.load_shared(handle, version, checksum, mode)

    @concurrent_endpoint
    async def sleep(self) -> None:
        await self.engine.sleep()

    @concurrent_endpoint
    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        await self.engine.wake_up(tags)

    @concurrent_endpoint
    async def stats(self) -> dict[str, Any]:
        return {"replica": self.replica, "host": host_name(), "pid": os.getpid(), **self.engine.stats()}

    @concurrent_endpoint
    async def close(self) -> None:
        await self.engine.close()
