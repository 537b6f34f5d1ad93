"""The CPU weight broadcast (gloo) between real processes: the sender's packed buffer arrives bit
for bit and verified, a wrong checksum is refused, a member that dies fails the sender's next
broadcast at once instead of hanging it, and the survivors then form a new group that delivers
the next version into the buffers they already hold. The engines' receiving ends: one refuses a
receive before any join, and the vLLM one's calls over its TP workers."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import queue
import re

import pytest
import torch

from rlactors.placement import free_port
from rlactors.weight_sync.broadcast import (
    BroadcastBroken,
    BufferReceiver,
    LocalReceiver,
    VLLMReceiver,
    WeightSender,
    worker_join,
    worker_load_staged,
    worker_stage,
)
from rlactors.weight_sync.checksum import ChecksumMismatch
from rlactors.weight_sync.packed import PackedLayout


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"embed": torch.randn(300, 64, generator=g).to(torch.bfloat16), "norm": torch.randn(64, generator=g)}


def _member(rank: int, port: int, new_port: int, results) -> None:
    weights = _weights()
    layout = PackedLayout.of(weights)
    cpu = torch.device("cpu")
    doubled = {name: tensor * 2 for name, tensor in weights.items()}  # version 3
    try:
        if rank == 0:
            sender = WeightSender(layout, cpu)
            sender.join("127.0.0.1", port, 3)
            layout.pack(weights, sender.buffer)
            asyncio.run(sender.broadcast())  # version 1
            asyncio.run(sender.broadcast())  # version 2, received with a wrong checksum
            try:
                asyncio.run(sender.broadcast())  # rank 2 has died
            except BroadcastBroken as e:
                results.put((rank, "error", f"{e} (group left: {sender.group is None})"))
            sender.join("127.0.0.1", new_port, 2)  # the survivors' group
            layout.pack(doubled, sender.buffer)
            asyncio.run(sender.broadcast())
            return
        receiver = BufferReceiver(layout, cpu)
        receiver.join("127.0.0.1", port, rank, 3)
        expected = layout.checksum(layout.pack(weights, layout.empty(cpu).zero_()))
        receiver.receive(1, expected)
        received = receiver.weights()
        same = all(torch.equal(received[k], v) and received[k].dtype == v.dtype for k, v in weights.items())
        try:
            receiver.receive(2, "0" * 32)
            refused = False
        except ChecksumMismatch:
            refused = True
        results.put((rank, "received", same and refused))
        if rank == 2:
            results.close()
            results.join_thread()  # the report is out
            os._exit(0)  # dies without leaving the group
        buffer = receiver.buffer.data_ptr()
        receiver.join("127.0.0.1", new_port, 1, 2)
        receiver.receive(3, layout.checksum(layout.pack(doubled, layout.empty(cpu).zero_())))
        received = receiver.weights()
        same = all(torch.equal(received[k], v) for k, v in doubled.items())
        results.put((rank, "regrouped", same and receiver.buffer.data_ptr() == buffer))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        results.put((rank, "failed", repr(e)))


def test_gloo_broadcast_delivers_verified_bits_a_dead_member_fails_it_and_survivors_regroup():
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port, new_port = free_port(), free_port()
    members = [context.Process(target=_member, args=(rank, port, new_port, results)) for rank in range(3)]
    for member in members:
        member.start()
    reports = []
    try:
        while len(reports) < 4:
            reports.append(results.get(timeout=90))
    except queue.Empty:
        raise AssertionError(f"members reported only {reports}") from None
    finally:
        for member in members:
            member.join(30)
            if member.is_alive():
                member.kill()
    assert sorted(r[:2] for r in reports) == [(0, "error"), (1, "received"), (1, "regrouped"), (2, "received")], reports
    assert all(ok for _, what, ok in reports if what in ("received", "regrouped"))
    error = next(text for _, what, text in reports if what == "error")
    assert re.search(r"Connection (closed by peer|reset)", error) and error.endswith("(group left: True)"), error


def test_a_receive_before_the_replica_joined_a_group_is_refused_and_loads_nothing():
    loads = []
    receiver = LocalReceiver(torch.device("cpu"), lambda weights, version: loads.append(version))
    with pytest.raises(RuntimeError, match="weights version 3: this replica has not joined a weight group"):
        receiver.receive(3, "0" * 32)
    assert loads == [] and receiver.buffer_receiver is None


def test_a_vllm_receiver_reaches_every_tp_worker_and_tells_the_engine_after_a_load():
    """The calls a vLLM engine's receiver makes (its NCCL run is on the GPU machines): each one a
    `collective_rpc` over the TP workers, the first worker's timings returned, and the engine
    told of the new version only once the load is done."""
    events = []

    class Engine:
        def collective_rpc(self, method, args=()):
            events.append((method, args))
            return [{"worker": 0}, {"worker": 1}] if method is not worker_join else [1, 2]

    receiver = VLLMReceiver(Engine(), loaded=lambda version: events.append(("loaded", version)))
    assert receiver.join("10.0.0.1", 29500, 1, 3, "layout") == [1, 2]
    assert receiver.receive(4, "c" * 32) == {"worker": 0}
    assert receiver.load(4) == {"worker": 0}
    assert events == [(worker_join, ("10.0.0.1", 29500, 1, 3, "layout")), (worker_stage, (4, "c" * 32)),
                      (worker_load_staged, ()), ("loaded", 4)]
