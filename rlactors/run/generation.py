"""The generator side of a run, as training (rlactors.run.controller) and evaluation
(rlactors.evaluate) start and call it: the router and its replicas on a proc of this host, the
gateway of an AgentEnv's harnesses, the generate call the Rollouter makes, and whether any
replica is left to make it."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from rlactors.actors.token_stream import stream_tokens
from rlactors.config import Config, gpu_layout
from rlactors.types import Completion, SamplingParams, TokenDelta


def spawn_router(config: Config, hosts: Any = None) -> tuple[Any, Any]:
    """A proc on this host and the GeneratorRouter on it, which starts the replicas of
    config.generator (on `hosts`, a job's generator hosts, else on this host; on the GPUs
    gpu_layout gives them with controller.device = "cuda")."""
    from monarch.actor import this_host

    from rlactors.actors.router import GeneratorRouter

    replica_gpus = gpu_layout(config)[1] if config.controller.device == "cuda" else None
    procs = this_host().spawn_procs(per_host={"procs": 1})
    router = procs.spawn("router", GeneratorRouter, config.generator, config.model, replica_gpus, hosts,
                         config.controller.unresponsive_timeout_s, kv_cache_bytes=planned_kv_cache(config))
    return procs, router


def planned_kv_cache(config: Config) -> int | None:
    """The KV cache bytes the memory plan gives each GPU of a vLLM replica that sleeps
    (`generator.sleep`), where the GPU's size is known; None: vLLM sizes its own."""
    from rlactors.models.checkpoint import load_args
    from rlactors.run.memory_plan import gpu_gib, vllm_kv_cache_bytes

    g = config.generator
    if g.engine != "vllm" or not g.sleep or config.controller.device != "cuda":
        return None
    gpu = gpu_gib(config)
    return None if gpu is None else vllm_kv_cache_bytes(config, load_args(config.model.path), gpu * 2**30)


def replicas_lost(stats: dict[str, Any], restart_dead: bool) -> str | None:
    """Why no rollout can be generated any more, from the router's `stats`: every replica is dead
    and none is restarting (`restart_dead` off, or the restarts failed); None while one may serve."""
    if stats["states"]["dead"] < len(stats["replicas"]) or stats["restarting"]:
        return None
    why = "their restarts failed" if restart_dead else "generator.restart_dead = false"
    return f"every generator replica is dead ({why}): no rollout can be generated"


async def serve_gateway(env: Any, config: Config, tokenizer: Any) -> Any:
    """An AgentEnv's harnesses reach the policy through the gateway, served from this process
    (on the router's host), whose address it prints; None for any other env. The caller stops it."""
    from rlactors.gateway import serve_agent_env

    gateway = await serve_agent_env(env, config.gateway, config.rollout.max_tokens_per_turn, tokenizer)
    if gateway is not None:
        print(f"gateway for {type(env).__name__} harnesses at {gateway.url}", flush=True)
    return gateway


async def generate(router: Any, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str,
                   session_id: str | None = None, base_version: int = 0,
                   on_tokens: Callable[[TokenDelta], Awaitable[None]] | None = None) -> Completion:
    """One completion from the router. The replicas number the weights they loaded from
    model.path 0: `base_version` is the policy version those weights are (a checkpoint's).
    Given `on_tokens`, it is awaited with each TokenDelta of the completion, in order, as they are
    sampled: together they are exactly the completion's tokens, the last of them before it returns."""
    if on_tokens is None:
        completion = await router.generate.call_one(prompt_token_ids, sampling, request_id, session_id)
    else:
        completion = await stream_tokens(
            lambda port: router.generate_streamed.call_one(prompt_token_ids, sampling, request_id, port, session_id),
            lambda delta: on_tokens(_shifted(delta, base_version)))
    if not base_version:
        return completion
    return dataclasses.replace(completion, versions=_shifted_versions(completion.versions, base_version))


def _shifted_versions(versions: list[int], base_version: int) -> list[int]:
    return [base_version + v if v >= 0 else v for v in versions]


def _shifted(delta: TokenDelta, base_version: int) -> TokenDelta:
    if not base_version:
        return delta
    return dataclasses.replace(delta, versions=_shifted_versions(delta.versions, base_version))
