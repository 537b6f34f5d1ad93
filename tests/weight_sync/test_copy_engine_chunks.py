"""On two GPUs, a group of one receiver: the trainer copies the packed chunks into the receiver's
own buffer with the copy engine (CUDA IPC), unless the receiver's process grows expandable
segments (then NCCL broadcasts them), and they arrive bit for bit and verified; the trainer writes
nothing into the buffer before the receiver receives, so a version still in it (waiting for its
load) stays intact until then. The second send replays the first's CUDA graph (or, as a trainer
of several ranks sends, enqueues it again) and carries the weights as changed in place since.
A send whose packing fails while it is being captured leaves its group with no graph, and the
next group's first send captures anew and delivers. Real processes, each seeing only its own
GPU, as the trainer's and a replica's do."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time

import pytest
import torch
from support.packed_weights import CHUNK_BYTES, pack_from, small_weights
from support.vllm_checks import NEEDS_VLLM_GPU

from rlactors.procs.placement import free_port
from rlactors.weight_sync.broadcast import BufferReceiver, WeightSender
from rlactors.weight_sync.packed import PackedLayout

pytestmark = [*NEEDS_VLLM_GPU, pytest.mark.two_gpus,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


def _member(rank: int, port: int, capture: bool, results) -> None:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    first, second = small_weights(device), small_weights(device, 2.0)
    layout = PackedLayout.of(first, chunk_bytes=CHUNK_BYTES)
    try:
        if rank == 0:
            policy = {name: tensor.clone() for name, tensor in first.items()}  # trained in place
            sender = WeightSender(layout, device, pack_from(policy, layout), capture=capture)
            sender.join("127.0.0.1", port, 2)
            sent = [asyncio.run(sender.send(1))]
            for name, tensor in policy.items():
                tensor.copy_(second[name])
            sent.append(asyncio.run(sender.send(2)))  # the first send's graph again, where captured
            results.put((rank, [(s["copy_engine"], s["verified"]) for s in sent]))
            return
        receiver = BufferReceiver(layout, device)
        receiver.join("127.0.0.1", port, 1, 2)

        def holds(weights):
            return all(torch.equal(receiver.weights()[name], tensor) for name, tensor in weights.items())

        receiver.receive(1)
        received_first = holds(first)
        time.sleep(1.0)  # meanwhile the trainer packs version 2 and waits for this receiver
        kept_first = holds(first)
        receiver.receive(2)
        results.put((rank, [receiver.lent, received_first, kept_first, holds(second)]))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        results.put((rank, repr(e)))


def _run_members(monkeypatch, alloc_conf: str, member, *args) -> dict:
    """Runs `member(rank, *args, results)` for ranks 0 and 1, each in a process of its own on a
    GPU of its own; returns what each put in `results`, by rank."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = [g.strip() for g in visible.split(",")][:2] if visible else ["0", "1"]
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    members = [ctx.Process(target=member, args=(rank, *args, results)) for rank in (0, 1)]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", alloc_conf)
    for gpu, process in zip(gpus, members):
        # Each sees its own GPU only, from its start: importing this module in it starts CUDA.
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", gpu)
        process.start()
    try:
        return dict(results.get(timeout=120) for _ in members)
    finally:
        for process in members:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()


@pytest.mark.parametrize("alloc_conf, copy_engine, capture", [
    ("expandable_segments:False", 1.0, True),
    # The receiver's process grows expandable segments, so it lends no buffer: NCCL chunks.
    ("expandable_segments:True", 0.0, True),
    # As a trainer of several ranks sends: enqueued at each send, not replayed.
    ("expandable_segments:False", 1.0, False),
])
def test_a_lone_receiver_gets_the_chunks_by_copy_engine_verified_and_only_while_it_receives(
        monkeypatch, alloc_conf, copy_engine, capture):
    got = _run_members(monkeypatch, alloc_conf, _member, free_port(), capture)
    assert got[0] == [(copy_engine, 1), (copy_engine, 1)], got
    assert got[1] == [copy_engine == 1.0, True, True, True], got


def _regrouping_member(rank: int, ports: tuple[int, int], joined, results) -> None:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    weights = small_weights(device)
    layout = PackedLayout.of(weights, chunk_bytes=CHUNK_BYTES)
    try:
        if rank == 0:
            failing, packing = [True], pack_from(weights, layout)

            def pack(chunk, buffer):
                if failing[0] and chunk is layout.chunks[2]:  # two chunks' work is captured before it
                    raise RuntimeError("the packing failed")
                packing(chunk, buffer)

            sender = WeightSender(layout, device, pack)
            sender.join("127.0.0.1", ports[0], 2)
            # As the controller does, sent once every member has joined: the failed send leaves
            # the group and so closes its store, which the receiver's join may still be reading.
            if not joined.wait(timeout=120):
                raise TimeoutError("the receiver did not join the first group")
            try:
                asyncio.run(sender.send(1))
                failed = None
            except RuntimeError as e:
                failed = str(e)
            left = (sender.graph is None, sender.group is None)
            failing[0] = False
            sender.join("127.0.0.1", ports[1], 2)
            sent = asyncio.run(sender.send(1))
            results.put((rank, [failed, left, sent["copy_engine"], sent["verified"], sender.graph is not None]))
            return
        receiver = BufferReceiver(layout, device)
        receiver.join("127.0.0.1", ports[0], 1, 2)  # the failed send never reaches it
        joined.set()
        receiver.join("127.0.0.1", ports[1], 1, 2)
        receiver.receive(1)
        held = all(torch.equal(receiver.weights()[name], tensor) for name, tensor in weights.items())
        results.put((rank, [receiver.lent, held]))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        results.put((rank, repr(e)))


def test_a_packing_that_fails_during_the_capture_leaves_the_group_and_the_next_group_captures_anew(monkeypatch):
    joined = multiprocessing.get_context("spawn").Event()
    got = _run_members(monkeypatch, "expandable_segments:False", _regrouping_member, (free_port(), free_port()), joined)
    # The second group's buffer is the one lent to the first: the trainer maps it again.
    assert got[0] == ["the packing failed", (True, True), 1.0, 1, True], got
    assert got[1] == [True, True], got
