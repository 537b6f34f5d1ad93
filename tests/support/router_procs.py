"""A GeneratorRouter of native replicas on real procs, random prompts, and waiting on its stats."""

from __future__ import annotations

import asyncio
import os

import torch
from monarch.actor import this_host

from rlactors.actors.router import GeneratorRouter
from rlactors.config import GeneratorConfig, ModelConfig

VOCAB = 1024  # the tiny checkpoints' vocabulary


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(k),), generator=g).tolist() for k in torch.randint(4, 40, (n,), generator=g)]


def spawn_router(ckpt, restart_dead: bool, replicas: int = 2, true_on_policy: bool = False):
    """(procs, router); the caller closes the router and stops the procs. With `true_on_policy`
    the replicas' logprobs do not depend on the batch or the prefix cache (bitwise comparable)."""
    os.environ["OMP_NUM_THREADS"] = "1"  # replica procs inherit the controller's environment
    config = GeneratorConfig(replicas=replicas, max_num_seqs=32, max_num_tokens=512, kv_cache_tokens=4096,
                             max_model_len=512, restart_dead=restart_dead)
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    model = ModelConfig(path=str(ckpt), true_on_policy=true_on_policy)
    return procs, procs.spawn("router", GeneratorRouter, config, model)


async def wait_for(router, condition, timeout: float = 60.0) -> dict:
    """The router's stats once `condition(stats)` holds; fails after `timeout` s."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        stats = await router.stats.call_one()
        if condition(stats):
            return stats
        assert asyncio.get_running_loop().time() < deadline, f"router never reached the state: {stats}"
        await asyncio.sleep(0.05)
