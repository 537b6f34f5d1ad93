"""GPU weight sync: trainer rank 0 broadcasts one packed buffer to every vLLM worker over NCCL.

The group is vLLM's stateless NCCL group (a TCP rendezvous plus a PyNcclCommunicator), so it
lives beside both torch.distributed worlds: the trainer's FSDP group and vLLM's TP group. The
trainer is rank 0; replica r's TP worker t is rank 1 + r * tp + t. Both sides must join at the
same time (the controller calls them together), and every broadcast likewise.

A receiver stages each broadcast in its own buffer, on a side stream, and checks its checksum
before loading anything: on a mismatch the replica keeps serving its current weights and the
error names the version. The load follows between engine steps; loads after the first are plain
copies from the buffer where a copy plan was proven equal to vLLM's loader.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import torch

from rlactors.weight_sync.checksum import ChecksumMismatch
from rlactors.weight_sync.copy_plan import CopyPlan
from rlactors.weight_sync.packed import PackedLayout


def local_address() -> str:
    """This host's address as the other hosts of the job reach it."""
    return socket.gethostbyname(socket.gethostname())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def join_group(host: str, port: int, rank: int, world_size: int, device: torch.device | int) -> Any:
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    group = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=world_size)
    return PyNcclCommunicator(group, device=device)


class WeightSender:
    """Trainer rank 0's side: a persistent send buffer (the trainer packs it) and the broadcast."""

    def __init__(self, host: str, port: int, world_size: int, layout: PackedLayout, device: torch.device):
        self.layout = layout
        self.buffer = layout.empty(device).zero_()  # zeroed once: padding bytes count in the checksum
        self.group = join_group(host, port, 0, world_size, device)

    def broadcast(self) -> dict[str, float]:
        """Sends the buffer as it is (the caller has packed it) to every receiver."""
        start = time.perf_counter()
        self.group.broadcast(self.buffer, src=0, stream=torch.cuda.current_stream())
        torch.cuda.current_stream().synchronize()
        return {"bytes": float(self.layout.total_bytes), "broadcast_s": time.perf_counter() - start}


# -- vLLM worker side: run through LLM.collective_rpc, `worker` is vLLM's worker object ----------


def _model(worker: Any) -> torch.nn.Module:
    return worker.get_model() if hasattr(worker, "get_model") else worker.model_runner.model


def worker_join(worker: Any, host: str, port: int, rank_offset: int, world_size: int, layout: PackedLayout) -> int:
    rank = rank_offset + worker.rank
    device = torch.device("cuda", torch.cuda.current_device())
    worker.rlactors_weight_group = join_group(host, port, rank, world_size, device)
    worker.rlactors_weight_buffer = layout.empty(device)
    worker.rlactors_weight_layout = layout
    worker.rlactors_stage_stream = torch.cuda.Stream(device)  # receives beside the engine's work
    return rank


def worker_stage(worker: Any, version: int, checksum: str) -> dict[str, float]:
    """Receives the broadcast into the worker's buffer and checks its checksum; the model's
    weights are untouched, so the engine may be generating meanwhile (on its own stream)."""
    layout: PackedLayout = worker.rlactors_weight_layout
    buffer: torch.Tensor = worker.rlactors_weight_buffer
    stream: torch.cuda.Stream = worker.rlactors_stage_stream
    start = time.perf_counter()
    with torch.cuda.stream(stream):
        worker.rlactors_weight_group.broadcast(buffer, src=0, stream=stream)
        received = layout.checksum(buffer)  # on the same stream, after the broadcast; waits for it
    if received != checksum:
        raise ChecksumMismatch(f"weights version {version}: received checksum {received}, trainer sent "
                               f"{checksum}; keeping the previous weights")
    return {"receive_verify_s": time.perf_counter() - start}


def worker_load_staged(worker: Any) -> dict[str, float]:
    """Loads the verified buffer into the model. The first load goes through vLLM's
    `load_weights` and derives the copy plan (rlactors.weight_sync.copy_plan) that later loads
    use where it was proven equal."""
    layout: PackedLayout = worker.rlactors_weight_layout
    buffer: torch.Tensor = worker.rlactors_weight_buffer
    start = time.perf_counter()
    plan = getattr(worker, "rlactors_copy_plan", None)
    if plan is not None:
        plan.apply()
    else:
        model = _model(worker)
        model.load_weights(layout.views(buffer))
        if not hasattr(worker, "rlactors_copy_plan"):
            worker.rlactors_copy_plan = CopyPlan.derive(model, layout, buffer)
    torch.cuda.current_stream().synchronize()  # the buffer may be overwritten by the next broadcast
    return {"load_s": time.perf_counter() - start, "copy_plan": float(plan is not None)}
