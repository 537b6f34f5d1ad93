"""Expert parallelism over the trainer mesh (``trainer.expert_parallel``): each sparse layer's
experts split by expert over the ranks, a token's rows sent to the ranks that hold its experts
and the results sent back (all-to-all).

``shard_experts`` makes every ``Experts`` parameter a DTensor sharded on dim 0 (the expert) over
the 1-D trainer mesh, the placement FSDP2 would give it, so loading, checkpoints and the weight
gather for sync read the same shards; FSDP leaves these parameters alone, so a rank computes
with its own experts and never gathers the others'.

Each rank multiplies the rows it receives source rank by source rank, as each source rank
multiplies its own rows without expert parallelism (``Experts.mlp``): the outputs and the
inputs' gradients are FSDP's bit for bit, and an expert's weight gradient sums the same per-rank
terms that FSDP's reduce-scatter sums (with 2 ranks that sum is exact in any order; with more,
its order may differ from the reduce-scatter's).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from rlactors.models.moe import Experts


class ExpertParallel:
    """``Experts.expert_parallel``: rank ``r`` of ``group`` holds experts ``[r * n, (r + 1) * n)``,
    ``n = num_experts / ranks``."""

    def __init__(self, group: dist.ProcessGroup, num_experts: int):
        self.group = group
        self.ranks = dist.get_world_size(group)
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
        gate_up, down = (p.to_local().to(rows.dtype) for p in (experts.gate_up_proj, experts.down_proj))
        out = torch.cat([experts.mlp(chunk, chunk_counts, gate_up, down)
                         for chunk, chunk_counts in zip(inputs.split(received), received_counts)])
        if not sum(received):
            # Keeps the (empty) received rows and this rank's experts in the graph: the backward
            # must still run the dispatch's all-to-all, which the other ranks run, and experts
            # that got no rows get a zero gradient, as under FSDP, so every rank steps alike.
            out = out + 0 * (inputs.sum() + gate_up.sum() + down.sum())
        return _AllToAll.apply(out, sent, received, self.group)


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
    """Shards every ``Experts`` module of ``model`` (on the meta device) by expert over the 1-D
    ``mesh`` (whose size divides the number of experts: ``config.check_model_keys``) and runs it
    expert-parallel; returns the sharded parameters, for FSDP to ignore."""
    sharded = set()
    for module in model.modules():
        if not isinstance(module, Experts):
            continue
        for name, param in list(module.named_parameters(recurse=False)):
            shard = nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]))
            setattr(module, name, shard)
            sharded.add(shard)
        module.expert_parallel = ExpertParallel(mesh.get_group(), module.num_experts)
    return sharded
