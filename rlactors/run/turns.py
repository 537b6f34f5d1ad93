"""Colocated GPUs held in turns (`generator.sleep`): the controller drives, each side acts.

Every GPU holds a trainer rank and a generator replica. A step goes
    generate (engines awake; the trainer holds its master weights, and its optimizer state
    unless `trainer.offload_optimizer`)
    -> `training`: the engines sleep (vLLM level 1: weights to host memory, KV cache freed)
    -> forward/backward, optimizer step (and checkpoint)
    -> `syncing`: the trainer hands its allocator's cached memory back to the device, the engines'
       weights wake (so the sync writes into them before the KV cache is allocated again)
    -> weight sync
    -> `generating`: the trainer hands back what the sync cached (rank 0 gathered the policy), the
       engines' KV caches wake.
Asleep, an engine serves nothing, so the turns need sync mode (checked at load).
`NoTurns` stands in where the engines keep their memory (without `generator.sleep`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from rlactors.procs.placement import first_value


class NoTurns:
    """Engines that keep their memory: every turn is a no-op."""

    async def training(self) -> dict[str, float]:
        return {}

    async def syncing(self) -> dict[str, float]:
        return {}

    async def generating(self) -> dict[str, float]:
        return {}


class Turns(NoTurns):
    """The turns of `trainer` (a PolicyTrainer mesh) and `router` (the GeneratorRouter) on shared
    GPUs. Each returns metrics: the seconds it took, the trainer's peak allocated memory over its
    step (`memory/trainer_peak_gib`), the peak its allocator reserved (`memory/trainer_peak_reserved_gib`)
    and what its allocator holds while the engines generate (`memory/trainer_held_gib`); all 0 on CPU."""

    def __init__(self, trainer: Any, router: Any):
        self.trainer, self.router = trainer, router

    async def training(self) -> dict[str, float]:
        start = time.perf_counter()
        await self.router.sleep.call_one()
        return {"turns/sleep_s": time.perf_counter() - start}

    async def syncing(self) -> dict[str, float]:
        start = time.perf_counter()
        released = first_value(await self.trainer.release_memory.call())
        await self.router.wake_up.call_one(["weights"])
        return {"turns/wake_weights_s": time.perf_counter() - start,
                "memory/trainer_peak_gib": released["peak_allocated_gib"],
                "memory/trainer_peak_reserved_gib": released["peak_reserved_gib"]}

    async def generating(self) -> dict[str, float]:
        start = time.perf_counter()
        # its peak since `syncing` is the sync's, not the step's; what it holds stays through generation
        released = first_value(await self.trainer.release_memory.call())
        await self.router.wake_up.call_one(["kv_cache"])
        return {"turns/wake_kv_cache_s": time.perf_counter() - start,
                "memory/trainer_held_gib": released["held_gib"]}


@dataclass
class StepUpdate:
    """What the trainer's part of a step gave: its training metrics, the sync's, each phase's
    seconds (train, checkpoint, sync) and the turns' metrics."""

    trained: dict[str, float]
    synced: dict[str, float]
    seconds: dict[str, float]
    turns: dict[str, float]


async def take_turns(turns: NoTurns, train: Callable[[], Awaitable[dict[str, float]]],
                     checkpoint: Callable[[], Awaitable[None]],
                     sync: Callable[[], Awaitable[dict[str, float]]]) -> StepUpdate:
    """The trainer's part of a step (after its rollouts): train, checkpoint, sync the weights,
    each in its turn on the GPUs (`turns`)."""
    seconds = {}

    async def timed(name: str, phase: Callable[[], Awaitable[Any]]) -> Any:
        start = time.perf_counter()
        try:
            return await phase()
        finally:
            seconds[name] = time.perf_counter() - start

    metrics = await turns.training()
    trained = await timed("train", train)
    await timed("checkpoint", checkpoint)
    metrics.update(await turns.syncing())
    synced = await timed("sync", sync)
    metrics.update(await turns.generating())
    return StepUpdate(trained, synced, seconds, metrics)
