"""The one place rlactors reaches vLLM: the vLLM names it uses, and the internals it touches.

Other modules take vLLM's objects from here (``from rlactors.vllm_api import LLMEngine``), never
from vllm itself. A name in ``NAMES`` is imported from its module where it is used, as a plain
import there would import it, after the installed vLLM's version is checked against
``SUPPORTED``: CPU installs never need vLLM, and an unsupported vLLM fails at its first use with
one line naming the range. What each name needs on later releases:
benchmarks/results/notes/vllm_upgrade.md.
"""

from __future__ import annotations

import functools
import importlib
import re
from typing import Any

import torch

SUPPORTED = ("0.31.0", "0.32.0")  # the lowest vLLM supported, and the first release that is not

# Every vLLM name rlactors uses, and the module it comes from.
NAMES: dict[str, str] = {
    # the engine (rlactors.engines.vllm_engine); LLM: raw vLLM, a benchmark's baseline
    "EngineArgs": "vllm",
    "LLMEngine": "vllm",
    "LLM": "vllm",
    "SamplingParams": "vllm",
    "RequestOutputKind": "vllm.sampling_params",
    "current_platform": "vllm.platforms",
    # true on-policy (rlactors.on_policy.vllm_model)
    "ModelRegistry": "vllm",
    "Attention": "vllm.model_executor.layers.attention.attention",
    "override_envs_for_invariance": "vllm.model_executor.determinism.batch_invariant",
    "compute_token_logprobs": "vllm.v1.worker.gpu.sample.logprob",
    "flash_attn_varlen_func": "vllm.v1.attention.backends.fa_utils",
    "get_flash_attn_version": "vllm.v1.attention.backends.fa_utils",
    # weight sync by NCCL (rlactors.weight_sync.broadcast)
    "PyNcclCommunicator": "vllm.distributed.device_communicators.pynccl",
    "StatelessProcessGroup": "vllm.distributed.utils",
}


class UnsupportedVLLM(ImportError):
    """The installed vLLM is outside ``SUPPORTED``."""


def _release(version: str) -> tuple[int, ...]:
    """The release numbers a version string starts with: "0.26.1.dev3+g1234" -> (0, 26, 1)."""
    match = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(part) for part in match.group().split(".")) if match else ()


@functools.cache  # a pass is kept: names are taken in hot paths (a trainer's every forward)
def check_version(installed: str) -> None:
    """Raises UnsupportedVLLM, in one line naming the supported range, unless `installed` is in it."""
    low, high = SUPPORTED
    if not _release(low) <= _release(installed) < _release(high):
        raise UnsupportedVLLM(f"rlactors supports vLLM >={low},<{high}; vLLM {installed} is installed")


def _load(name: str) -> Any:
    """vLLM's `name`, from its module in ``NAMES``, once the installed vLLM is checked."""
    if name not in NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r} (vLLM names it declares: NAMES)")
    check_version(importlib.import_module("vllm").__version__)
    return getattr(importlib.import_module(NAMES[name]), name)


def __getattr__(name: str) -> Any:
    return _load(name)


def worker_model(worker: Any) -> torch.nn.Module:
    """The model a vLLM worker (the object `collective_rpc` hands a function) runs."""
    return worker.get_model() if hasattr(worker, "get_model") else worker.model_runner.model


def _engine_core(llm_engine: Any) -> Any:
    """The EngineCore of an in-process LLMEngine (its InprocClient's)."""
    return llm_engine.engine_core.engine_core


def pause_scheduler(llm_engine: Any) -> None:
    """Pauses an in-process LLMEngine's scheduler, keeping its requests: its next steps only
    finish the steps already in flight (their outputs come from `step()`)."""
    _engine_core(llm_engine).pause_scheduler(mode="keep", clear_cache=False)


def steps_in_flight(llm_engine: Any) -> bool:
    """Whether an in-process LLMEngine has scheduled steps whose outputs it has not returned (under
    async scheduling, the step after the one `step()` returned)."""
    return bool(_engine_core(llm_engine).batch_queue)


def resume_scheduler(llm_engine: Any) -> None:
    _engine_core(llm_engine).resume_scheduler()


def scheduler_paused(llm_engine: Any) -> bool:
    """Whether an in-process LLMEngine's scheduler is paused (`pause_scheduler`, or asleep)."""
    return _engine_core(llm_engine).is_scheduler_paused()


def shut_down(llm_engine: Any) -> None:
    """Shuts an in-process LLMEngine down and gives back what vLLM keeps past its shutdown.

    The last closed engine of a process kept its KV cache (all of it: gigabytes): its model stays
    reachable from module-level state, and its attention layers hold the cache, so the cache is
    dropped from them. vLLM keeps one CUDA graph pool id for the whole process (a class
    attribute); capturing into a pool whose graphs were all freed trips PyTorch's allocator
    ('use_count > 0 INTERNAL ASSERT', vllm-project/vllm#49224): the next engine gets a pool of its own.
    """
    layers = list(llm_engine.vllm_config.compilation_config.static_forward_context.values())
    llm_engine.engine_core.shutdown()  # empties that registry: the layers were listed before
    for layer in layers:
        if isinstance(getattr(layer, "kv_cache", None), torch.Tensor):
            layer.kv_cache = torch.empty(0)
    type(_load("current_platform"))._global_graph_pool = None
