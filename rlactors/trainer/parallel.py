"""torch.distributed setup and FSDP2 sharding of the policy over the data-parallel mesh."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.utils.checkpoint import checkpoint

from rlactors.models.args import ModelArgs
from rlactors.models.decoder import DecoderForCausalLM
from rlactors.trainer.expert_parallel import shard_experts


def init_distributed(device_type: str) -> torch.device:
    """Joins the default process group from torch elastic env vars (RANK, WORLD_SIZE, MASTER_*).

    gloo on CPU; on CUDA, NCCL for CUDA tensors and gloo for CPU ones. Each trainer proc sees one
    GPU through CUDA_VISIBLE_DEVICES (set at spawn); where several are visible, LOCAL_RANK picks
    one. Returns this rank's device.
    """
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device_type!r}")
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' asked for, but CUDA is not available in this process")
        index = 0 if torch.cuda.device_count() == 1 else int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise ValueError(f"torch.distributed env vars missing: {missing} (setup_torch_elastic_env sets them)")
        if device_type == "cuda":
            dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    return device


def checkpoint_activations(layer: nn.Module) -> None:
    """Recomputes `layer`'s activations in backward instead of keeping them.

    Wraps the instance's forward rather than the module, so parameter names stay HF's.
    """
    forward = layer.forward

    def checkpointed_forward(*args):
        return checkpoint(forward, *args, use_reentrant=False)

    layer.forward = checkpointed_forward


def compile_layer(layer: nn.Module) -> None:
    """torch.compile's the layer's forward, fusing its norms, RoPE and activations.

    The instance's forward is replaced, so parameter names stay HF's and FSDP's hooks (in
    `__call__`) stay outside the compiled code.
    """
    layer.forward = torch.compile(layer.forward)


def build_sharded_model(
    args: ModelArgs,
    mesh: DeviceMesh,
    device: torch.device,
    mixed_precision: bool,
    activation_checkpointing: bool,
    compile_layers: bool,
    convert: Callable[[nn.Module], None] | None = None,
    expert_parallel: bool = False,
) -> DecoderForCausalLM:
    """An FSDP2-sharded model with uninitialised fp32 shards on `device` (load weights next).

    Built on the meta device, so no rank ever holds the full model. Each decoder layer is one
    FSDP unit; the root unit holds the embedding, final norm and LM head. Gradients are summed
    over ranks, not averaged: the loss is already normalised by the step's global token count.
    With `mixed_precision`, parameters are all-gathered and computed in bf16 while the fp32
    shards stay the master weights and gradients are reduced in fp32. `compile_layers` compiles
    each decoder layer (CUDA: the eager layer is bound by its elementwise kernels). `convert`
    (true on-policy's module swap) is applied to the plain model first. With `expert_parallel`,
    the experts are sharded by expert over `mesh` outside FSDP (`rlactors.trainer.expert_parallel`).
    """
    with torch.device("meta"):
        model = DecoderForCausalLM(args)
    if convert is not None:
        convert(model)
    experts = shard_experts(model, mesh) if expert_parallel else set()
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if mixed_precision else None,
        reduce_dtype=torch.float32 if mixed_precision else None,
    )
    for layer in model.model.layers:
        if compile_layers:
            compile_layer(layer)
        if activation_checkpointing:
            checkpoint_activations(layer)
        fully_shard(layer, mesh=mesh, mp_policy=policy, ignored_params=experts)
    fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=experts)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # gloo has no PREMUL_SUM; a plain SUM with a no-op scale is the same reduction.
            module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device=device)
    return model


def local_rows(param: nn.Parameter) -> tuple[torch.Tensor, int]:
    """This rank's part of a parameter sharded on dim 0 over a 1-D mesh (FSDP2), and the index
    of its first row in the full tensor; a plain tensor is all of itself, from row 0.

    FSDP2 splits dim 0 as torch.chunk does: ceil(rows / ranks) rows per rank, the last ones
    shorter or empty.
    """
    if not isinstance(param, DTensor):
        return param.data, 0
    if param.device_mesh.ndim != 1 or param.placements != (Shard(0),):
        raise ValueError(f"expected a parameter sharded on dim 0 of a 1-D mesh, got {param.placements}")
    rows, ranks = param.shape[0], param.device_mesh.size()
    first = min(param.device_mesh.get_local_rank() * -(-rows // ranks), rows)
    local = param.to_local()
    if local.shape[1:] != param.shape[1:] or first + local.shape[0] > rows:
        raise ValueError(f"shard of {tuple(local.shape)} at row {first} does not fit {tuple(param.shape)}")
    return local, first


def make_mesh(device: torch.device) -> DeviceMesh:
    return init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))


def clip_grad_norm_(parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clips the gradients of sharded parameters to a global L2 norm; returns the norm before.

    The per-shard norms of DTensor gradients are partial results; full_tensor() reduces them
    over the mesh. A non-finite norm leaves the gradients as they are.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if torch.isfinite(norm):
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
    return norm
