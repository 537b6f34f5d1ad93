"""A GeneratorRouter of native replicas on real procs."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

from monarch.actor import this_host

from rlactors.actors.router import GeneratorRouter
from rlactors.config import GeneratorConfig, ModelConfig


def spawn_router(ckpt, restart_dead: bool, replicas: int = 2):
    """(procs, router); the caller closes the router and stops the procs."""
    os.environ["OMP_NUM_THREADS"] = "1"  # replica procs inherit the controller's environment
    config = GeneratorConfig(replicas=replicas, max_num_seqs=32, max_num_tokens=512, kv_cache_tokens=4096,
                             max_model_len=512, restart_dead=restart_dead)
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    return procs, procs.spawn("router", GeneratorRouter, config, ModelConfig(path=str(ckpt)))


async def stats_when(router, condition: Callable[[dict[str, Any]], bool], timeout: float = 60.0,
                     interval: float = 0.05) -> dict[str, Any]:
    """The router's stats once `condition(stats)` holds; fails showing the last stats after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await router.stats.call_one()
        if condition(stats):
            return stats
        assert time.monotonic() < deadline, f"router never reached the state: {stats}"
        await asyncio.sleep(interval)
