"""torch.distributed setup and FSDP2 sharding of the policy over the data-parallel mesh."""

from __future__ import annotations

import itertools
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
    expert_mesh: DeviceMesh | None = None,
) -> DecoderForCausalLM:
    """An FSDP2-sharded model with uninitialised fp32 shards on `device` (load weights next).

    Built on the meta device, so no rank ever holds the full model. Each decoder layer is one
    FSDP unit; the root unit holds the embedding, final norm and LM head. Gradients are summed
    over ranks, not averaged: the loss is already normalised by the step's global token count.
    With `mixed_precision`, parameters are all-gathered and computed in bf16 while the fp32
    shards stay the master weights and gradients are reduced in fp32. `compile_layers` compiles
    each decoder layer and the LM head's log-softmax kernels (CUDA: eager, both are bound by their
    elementwise passes). `convert` (true on-policy's module swap) is applied to the plain model
    first. With `expert_mesh`, the experts are sharded by expert within each of its
    expert-parallel groups, outside FSDP (`rlactors.trainer.expert_parallel`).
    """
    with torch.device("meta"):
        model = DecoderForCausalLM(args)
    if convert is not None:
        convert(model)
    experts = shard_experts(model, expert_mesh) if expert_mesh is not None else set()
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
    if compile_layers:
        model.log_softmax.compile_kernels()
    fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=experts)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # gloo has no PREMUL_SUM; a plain SUM with a no-op scale is the same reduction.
            module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device=device)
    return model


def held_rows(param: nn.Parameter) -> list[tuple[int, int]]:
    """The rows of `param` each rank holds, by global rank: (first row, rows). A plain tensor is
    all of itself on every rank; a DTensor is sharded on dim 0 over one dim of its mesh (FSDP2's
    mesh, or the expert mesh's `expert` dim: `rlactors.trainer.expert_parallel`), as torch.chunk splits it
    (ceil(rows / shards) rows per shard, the last ones shorter or empty), and replicated over the
    others.
    """
    rows = param.shape[0]
    if not isinstance(param, DTensor):
        return [(0, rows)] * dist.get_world_size()
    sharded = [dim for dim, placement in enumerate(param.placements) if not placement.is_replicate()]
    if len(sharded) != 1 or param.placements[sharded[0]] != Shard(0):
        raise ValueError(f"expected a parameter sharded on dim 0 over one mesh dim, got {param.placements}")
    mesh, dim = param.device_mesh, sharded[0]
    per_shard = -(-rows // mesh.size(dim))
    held = {}
    for index in itertools.product(*map(range, mesh.mesh.shape)):
        first = min(index[dim] * per_shard, rows)
        held[int(mesh.mesh[index])] = (first, min(per_shard, rows - first))
    return [held[rank] for rank in sorted(held)]


def local_rows(param: nn.Parameter) -> tuple[torch.Tensor, int]:
    """This rank's part of a parameter (`held_rows`), and the index of its first row in the full
    tensor; a plain tensor is all of itself, from row 0."""
    if not isinstance(param, DTensor):
        return param.data, 0
    first, rows = held_rows(param)[dist.get_rank()]
    local = param.to_local()
    if local.shape != (rows, *param.shape[1:]):
        raise ValueError(f"shard of {tuple(local.shape)} at row {first} does not fit {tuple(param.shape)}")
    return local, first


def make_mesh(device: torch.device) -> DeviceMesh:
    return init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))


def clip_grad_norm_(parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clips the gradients of sharded parameters to a global L2 norm; returns the norm before.

    Each rank takes the norm of the gradient rows it holds, counting rows replicated over ranks
    (the experts' under expert parallelism) on the first of them only, and the ranks' squared
    norms are summed: what DTensor's full_tensor() does with a partial norm, on every mesh. A
    non-finite norm leaves the gradients as they are.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    counted = [g.to_local() if isinstance(g, DTensor) else g for g in grads if _first_copy(g)]
    # foreach=False: one vector_norm per tensor, as get_total_norm takes DTensors' norms.
    norm = torch.nn.utils.get_total_norm(counted, 2.0, foreach=False) ** 2.0
    dist.all_reduce(norm)
    norm = norm ** 0.5
    if torch.isfinite(norm):
        # clip_grads_with_norm_'s scale, on the local rows
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_([g.to_local() if isinstance(g, DTensor) else g for g in grads], scale)
    return norm


def _first_copy(tensor: torch.Tensor) -> bool:
    """Whether this rank holds the first copy of its rows of `tensor` (`held_rows`)."""
    if not isinstance(tensor, DTensor):
        return dist.get_rank() == 0
    coordinate = tensor.device_mesh.get_coordinate()
    return all(c == 0 for c, p in zip(coordinate, tensor.placements) if p.is_replicate())
