"""A GeneratorRouter of native replicas on real procs."""

from __future__ import annotations

import os

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
