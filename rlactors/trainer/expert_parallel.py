"""Expert parallelism (``trainer.expert_parallel = E``): each sparse layer's experts split by
expert over groups of ``E`` consecutive trainer ranks, a token's rows sent to the ranks of its
group that hold its experts and the results sent back (all-to-all).

The ``R`` ranks form an ``R/E x E`` mesh (``expert_mesh``, dims ``replica`` and ``expert``): a row
is an expert-parallel group holding every expert; a column's ranks hold the same experts.
``shard_experts`` makes every ``Experts`` parameter a DTensor on that mesh (sharded on the expert
dim within a group, replicated over groups), so loading, checkpoints and the sync's gather read it
like FSDP's; the dense parameters stay FSDP over all ``R`` ranks. Each rank multiplies the rows it
receives source rank by source rank, so outputs and input gradients are FSDP's bit for bit; an
expert's weight gradient sums the same terms as FSDP's reduce-scatter, in an order that may
differ beyond 2 terms. Under mixed precision the terms add in fp32 (``shared_cast``). The
argument in full: docs/ARCHITECTURE.md, "Training".
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from rlactors.models.moe import Experts


def expert_mesh(device_type: str, expert_parallel: int) -> DeviceMesh:
    """The ``("replica", "expert")`` mesh of all ranks: ``expert_parallel`` consecutive ranks a row
    (``expert_parallel`` divides the ranks: ``TrainerConfig.validate``)."""
    ranks = dist.get_world_size()
    return init_device_mesh(device_type, (ranks // expert_parallel, expert_parallel),
                            mesh_dim_names=("replica", "expert"))


class ExpertParallel:
    """``Experts.expert_parallel``: rank ``r`` of its expert-parallel ``group`` (a row of the
    expert mesh) holds experts ``[r * n, (r + 1) * n)``, ``n = num_experts / ranks``; ``replicas``
    (its column) hold the same."""

    def __init__(self, mesh: DeviceMesh, num_experts: int):
        self.group, self.replicas = mesh.get_group("expert"), mesh.get_group("replica")
        self.ranks = dist.get_world_size(self.group)
        self.local_experts = num_experts // self.ranks

    # Eager inside a torch.compile'd layer (trainer.compile_layers): the exchange reads the counts
    # on the host and runs collectives.
    @torch.compiler.disable
    def __call__(self, experts: Experts, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``Experts.mlp`` of ``rows`` grouped by expert (``counts [E]`` rows each), computed on
        the ranks that hold the experts."""
        received_counts = torch.empty_like(counts)  # [source rank, local expert]: rows to compute
        dist.all_to_all_single(received_counts, counts, group=self.group)
        received_counts = received_counts.view(self.ranks, self.local_experts)
        sent = counts.view(self.ranks, self.local_experts).sum(1).tolist()
        received = received_counts.sum(1).tolist()
        inputs = _AllToAll.apply(rows, received, sent, self.group)
        gate_up, down = (p.to_local() for p in (experts.gate_up_proj, experts.down_proj))
        cast = [w.detach().to(rows.dtype) for w in (gate_up, down)]  # once, for every source rank
        # A source rank that sent no rows is skipped: on CUDA torch's grouped GEMM refuses the
        # weight gradient of no rows (a contraction of length 0), which true on-policy's backward asks.
        outputs = [experts.mlp(chunk, chunk_counts, shared_cast(gate_up, cast[0]), shared_cast(down, cast[1]))
                   for chunk, chunk_counts in zip(inputs.split(received), received_counts) if len(chunk)]
        if outputs:
            out = torch.cat(outputs)
        else:
            # Keeps the (empty) received rows and this rank's experts in the graph: the backward
            # must still run the dispatch's all-to-all, which the other ranks run, and experts
            # that got no rows get a zero gradient, as under FSDP, so every rank steps alike.
            out = inputs.new_empty(0, down.shape[1]) + 0 * (inputs.sum() + gate_up.sum() + down.sum())
        return _AllToAll.apply(out, sent, received, self.group)


def shared_cast(weight: torch.Tensor, cast: torch.Tensor) -> torch.Tensor:
    """``cast`` (``weight`` cast to the compute dtype once, shared by several uses, so autograd
    keeps one copy) as a use of ``weight``: its gradient comes back in ``weight``'s dtype, so the
    gradients of several uses add in that dtype (fp32), as FSDP adds the ranks' in its fp32
    reduction; several uses of one ``weight.to(dtype)`` would add them in bf16 first."""
    return _SharedCast.apply(weight, cast)


class _SharedCast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight: torch.Tensor, cast: torch.Tensor) -> torch.Tensor:
        ctx.dtype = weight.dtype
        return cast.view_as(cast)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.dtype), None


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows (``input_splits[r]`` of them to rank ``r``, ``output_splits[r]``
    from it); its backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, output_splits: list[int], input_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, input_splits, output_splits, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
    out = x.new_empty(sum(output_splits), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


def shard_experts(model: nn.Module, mesh: DeviceMesh) -> set[nn.Parameter]:
    """Shards every ``Experts`` module of ``model`` (on the meta device) by expert within each
    group of the expert ``mesh`` (``expert_mesh``; the group size divides the number of experts:
    ``config.check_model_keys``), replicated over the groups, and runs it expert-parallel; returns
    the sharded parameters, for FSDP to ignore."""
    sharded = set()
    for module in model.modules():
        if not isinstance(module, Experts):
            continue
        for name, param in list(module.named_parameters(recurse=False)):
            shard = nn.Parameter(distribute_tensor(param, mesh, [Replicate(), Shard(0)]))
            setattr(module, name, shard)
            sharded.add(shard)
        module.expert_parallel = ExpertParallel(mesh, module.num_experts)
    return sharded


def backward(model: nn.Module, loss: torch.Tensor) -> None:
    """``loss.backward()``; with expert replicas, each expert gradient it gives is then summed over
    the replicas and added to what earlier backwards accumulated (gradient accumulation), as FSDP
    reduces and accumulates the others."""
    experts = [m for m in model.modules() if isinstance(m, Experts) and m.expert_parallel is not None]
    if not experts or dist.get_world_size(experts[0].expert_parallel.replicas) == 1:
        loss.backward()
        return
    params = [p for m in experts for p in m.parameters(recurse=False)]
    accumulated = [p.grad for p in params]
    for p in params:
        p.grad = None
    loss.backward()
    # Every rank's backward gives every expert a gradient (zero for experts that got no rows:
    # ``ExpertParallel``), so all ranks run these reductions alike, in parameter order.
    for p, earlier in zip(params, accumulated):
        dist.all_reduce(p.grad.to_local(), group=experts[0].expert_parallel.replicas)
        if earlier is not None:
            earlier.to_local().add_(p.grad.to_local())
            p.grad = earlier
