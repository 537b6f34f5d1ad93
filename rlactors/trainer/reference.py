"""The reference policy of the KL term (`loss.kl_coef`): a frozen copy of the initial weights.

Held by the trainer ranks, sharded over them like the policy (FSDP2, experts expert-parallel), in
`model.dtype`, with no gradients and no optimizer state; it scores the same packed microbatches as
the policy. `reference_bytes_per_rank` is its memory on a rank, for a memory plan to count.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from rlactors.models.args import ModelArgs
from rlactors.models.checkpoint import model_shapes, open_tensors
from rlactors.on_policy.sides import TrainerSide
from rlactors.trainer import expert_parallel
from rlactors.trainer.batch import MicroBatch
from rlactors.trainer.parallel import build_sharded_model, local_rows, make_mesh


def reference_bytes_per_rank(args: ModelArgs, dtype: torch.dtype, ranks: int, expert_parallel: int = 1) -> int:
    """Bytes of the reference copy on the fullest of `ranks` trainer ranks: each parameter's rows
    split as the policy's are (ceil(rows / ranks), the experts' over `expert_parallel` ranks)."""
    if ranks < 1 or expert_parallel < 1 or ranks % expert_parallel:
        raise ValueError(f"ranks ({ranks}) must be >= 1 and a multiple of expert_parallel ({expert_parallel})")
    total = 0
    for name, shape in model_shapes(args).items():
        shards = expert_parallel if ".mlp.experts." in name and expert_parallel > 1 else ranks
        total += -(-shape[0] // shards) * shape[1:].numel()
    return total * dtype.itemsize


def load_sharded_weights(model: nn.Module, path: str | Path, given: dict[str, torch.Tensor] | None = None) -> None:
    """Each rank reads only its own rows of every parameter from the HF safetensors files; the
    parameters named in `given` (LoRA's adapters) from there instead."""
    given = given or {}
    with torch.no_grad(), open_tensors(path) as tensors:
        for name, param in model.named_parameters():  # a tied lm_head comes once, as the embedding
            local, first_row = local_rows(param)
            source = given[name] if name in given else tensors[name]
            local.copy_(source[first_row:first_row + local.shape[0]])


class ReferencePolicy:
    """The checkpoint in `path`, frozen in `dtype`, sharded over this process group's ranks."""

    def __init__(self, args: ModelArgs, path: str | Path, device: torch.device, dtype: torch.dtype,
                 kernels: TrainerSide, expert_parallel_ranks: int = 1, logprob_chunk_tokens: int = 1024):
        def convert(model: nn.Module) -> None:
            if kernels.convert is not None:
                kernels.convert(model)
            model.to(dtype)  # on the meta device: only the dtype the shards are made in

        self.model = build_sharded_model(
            args, make_mesh(device), device, mixed_precision=False, activation_checkpointing=False,
            compile_layers=False, convert=convert,
            expert_mesh=(expert_parallel.expert_mesh(device.type, expert_parallel_ranks)
                         if expert_parallel_ranks > 1 else None))
        load_sharded_weights(self.model, path)
        self.model.requires_grad_(False)
        self._attention, self._chunk = kernels.attention, logprob_chunk_tokens

    @torch.no_grad()
    def logprobs(self, mb: MicroBatch) -> torch.Tensor:
        """fp32 logprobs of `mb`'s targets (on its device), flattened; a collective over the ranks."""
        positions = mb.positions.reshape(-1)
        hidden = self.model(mb.input_ids.reshape(-1), positions, self._attention(positions))
        logprobs = self.model.token_logprobs(hidden, mb.target_ids.reshape(-1), self._chunk)
        self.model.reshard()  # the root FSDP unit keeps its parameters gathered after forward
        return logprobs

    def local_bytes(self) -> int:
        """Bytes of this rank's shards."""
        return sum(local_rows(p)[0].nbytes for p in self.model.parameters())
