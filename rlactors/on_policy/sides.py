"""What the trainer and the generator run, for one mode and one generator engine: ``sides``, the one
place where true on-policy picks its kernels.

In true on-policy mode both sides of the logprob comparison compute a token's logprob with the same
kernels, so they agree bit for bit: with the native engine, the batch-invariant ops and attention of
this package on both sides; with vLLM, our decoder inside vLLM (``vllm_model``) and, in the trainer,
vLLM's attention and sampled-token logprob kernels. Off, every side runs its defaults.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rlactors.attention.varlen import VarlenAttention
from rlactors.models.decoder import Attention
from rlactors.on_policy import vllm_model
from rlactors.on_policy.attention import BatchInvariantAttention, BatchInvariantPagedAttention
from rlactors.on_policy.modules import to_batch_invariant

GENERATOR_ENGINES = ("native", "vllm")


@dataclass(frozen=True)
class TrainerSide:
    """What the trainer runs."""

    convert: Callable[[nn.Module], None] | None  # applied to the plain model before it is sharded
    attention: Callable[[torch.Tensor], Attention]  # the attention of a packed batch, from its positions
    eager: bool  # the decoder layers must not be compiled (Inductor fuses and rounds differently)
    # Run in each trainer process before its process group: the weight group's NCCL communicator
    # is shared with vLLM replicas, whose NCCL settings every member must have.
    before_process_group: Callable[[], None] | None = None


@dataclass(frozen=True)
class NativeEngineSide:
    """What the native engine runs in place of its defaults."""

    convert: Callable[[nn.Module], None] | None  # applied to the loaded model
    attention: Callable[[Any, list], Attention] | None  # (KV cache, chunks) -> attention; None: the engine's
    kv_cache_dtype: torch.dtype | None  # None: the model's dtype


@dataclass(frozen=True)
class VLLMSide:
    """What a vLLM replica runs: environment vLLM must see before it is imported, an architecture to
    register, and the EngineArgs fields beside model, sizes and dtype."""

    environment: dict[str, str]
    register: Callable[[], None] | None
    engine_args: dict[str, Any] | None


@dataclass(frozen=True)
class Sides:
    trainer: TrainerSide
    generator: NativeEngineSide | VLLMSide


def sides(true_on_policy: bool, generator_engine: str, device: torch.device | str) -> Sides:
    """The trainer's and the generator's kernels for ``model.true_on_policy`` with
    ``generator.engine`` on ``device`` (``controller.device``: the trainer's and the native
    engine's)."""
    if generator_engine not in GENERATOR_ENGINES:
        raise ValueError(f"generator engine must be one of {GENERATOR_ENGINES}, got {generator_engine!r}")
    if not true_on_policy:
        trainer = TrainerSide(convert=None, attention=VarlenAttention.from_positions, eager=False)
        if generator_engine == "vllm":
            return Sides(trainer, VLLMSide(environment={}, register=None, engine_args=None))
        return Sides(trainer, NativeEngineSide(convert=None, attention=None, kv_cache_dtype=None))
    on_cpu = torch.device(device).type == "cpu"
    if generator_engine == "vllm":
        trainer = TrainerSide(
            convert=functools.partial(to_batch_invariant, log_softmax=vllm_model.VLLMLogSoftmax),
            attention=vllm_model.PagedFlashAttention.from_positions, eager=True,
            before_process_group=None if on_cpu else vllm_model.share_replica_nccl_settings)
        return Sides(trainer, VLLMSide(environment=vllm_model.true_on_policy_environment(),
                                       register=vllm_model.register,
                                       engine_args=vllm_model.TRUE_ON_POLICY_ENGINE_ARGS))
    trainer = TrainerSide(convert=to_batch_invariant, attention=BatchInvariantAttention.from_positions, eager=True)
    # On CPU the attention kernel reads fp32, which holds any model dtype's K/V exactly.
    native = NativeEngineSide(convert=functools.partial(to_batch_invariant, weights_frozen=True),
                              attention=BatchInvariantPagedAttention,
                              kv_cache_dtype=torch.float32 if on_cpu else None)
    return Sides(trainer, native)
