"""The CPU weight broadcast (gloo) between real processes: the sender's buffer, packed and sent in
chunks, arrives bit for bit and verified; a broadcast of another version than expected, or with a
bit flipped on the way, is refused; the sender learns how many members verified each broadcast; a
member that dies fails the sender's next broadcast at once instead of hanging it, and the
survivors then form a new group that delivers the next version into the buffers they already
hold. A lone receiver on GPUs lends its buffer to the trainer, which copies the chunks into it
only where it can map it (same host, CUDA IPC granted), and tells the receiver which way they
come. The engines' receiving ends: one refuses a receive before any join, and the vLLM one's calls
over its TP workers."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import queue
import re
import socket

import pytest
import torch
from support.packed_weights import CHUNK_BYTES, pack_from, small_weights

from rlactors.procs.placement import free_port
from rlactors.weight_sync.broadcast import (
    BroadcastBroken,
    BufferReceiver,
    LocalReceiver,
    UnexpectedVersion,
    VLLMReceiver,
    WeightSender,
    borrow_buffer,
    lend_buffer,
    worker_join,
    worker_load_staged,
    worker_stage,
)
from rlactors.weight_sync.checksum import ChecksumMismatch
from rlactors.weight_sync.packed import PackedLayout


class _FlipsAByte:
    """A group whose receives come with one bit flipped in the first chunk: a transport fault."""

    def __init__(self, group):
        self.group, self.flipped = group, False

    def broadcast(self, tensor, src, stream=None):
        self.group.broadcast(tensor, src, stream)
        if not self.flipped and tensor.dtype == torch.uint8:
            tensor[100] ^= 1
            self.flipped = True

    def all_reduce(self, in_tensor, out_tensor, stream=None):
        return self.group.all_reduce(in_tensor, out_tensor, stream)


def _member(rank: int, port: int, new_port: int, results) -> None:
    weights = small_weights()
    layout = PackedLayout.of(weights, chunk_bytes=CHUNK_BYTES)
    cpu = torch.device("cpu")
    doubled = {name: tensor * 2 for name, tensor in weights.items()}
    try:
        if rank == 0:
            policy = {name: tensor.clone() for name, tensor in weights.items()}  # trained in place
            sender = WeightSender(layout, cpu, pack_from(policy, layout))
            sender.join("127.0.0.1", port, 3)
            sent = asyncio.run(sender.send(1))
            whole = layout.checksum(layout.pack(weights, layout.empty(cpu).zero_()))
            results.put((rank, "sent", sent["checksum"] == whole and len(layout.chunks) == 10))
            verified = [sent["verified"]]
            verified.append(asyncio.run(sender.send(2))["verified"])  # taken for 3
            verified.append(asyncio.run(sender.send(3))["verified"])  # a bit flips
            try:
                asyncio.run(sender.send(4))  # rank 2 has died
            except BroadcastBroken as e:
                results.put((rank, "error", f"{e} (group left: {sender.group is None})"))
            sender.join("127.0.0.1", new_port, 2)  # the survivors' group
            for name, tensor in policy.items():
                tensor.copy_(doubled[name])
            verified.append(asyncio.run(sender.send(5))["verified"])
            results.put((rank, "verified", verified))
            return
        receiver = BufferReceiver(layout, cpu)
        receiver.join("127.0.0.1", port, rank, 3)
        receiver.receive(1)
        received = receiver.weights()
        same = all(torch.equal(received[k], v) and received[k].dtype == v.dtype for k, v in weights.items())
        with pytest.raises(UnexpectedVersion, match="weights version 3 expected, the broadcast carried version 2"):
            receiver.receive(3)
        receiver.group = _FlipsAByte(receiver.group)
        with pytest.raises(ChecksumMismatch, match="weights version 3: received checksum [0-9a-f]{32}, trainer sent"):
            receiver.receive(3)
        results.put((rank, "received", same))
        if rank == 2:
            results.close()
            results.join_thread()  # the report is out
            os._exit(0)  # dies without leaving the group
        buffer = receiver.buffer.data_ptr()
        receiver.join("127.0.0.1", new_port, 1, 2)
        receiver.receive(5)
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
        while len(reports) < 6:
            reports.append(results.get(timeout=90))
    except queue.Empty:
        raise AssertionError(f"members reported only {reports}") from None
    finally:
        for member in members:
            member.join(30)
            if member.is_alive():
                member.kill()
    assert sorted(r[:2] for r in reports) == [(0, "error"), (0, "sent"), (0, "verified"), (1, "received"),
                                              (1, "regrouped"), (2, "received")], reports
    assert all(ok for _, what, ok in reports if what in ("sent", "received", "regrouped")), reports
    # Both members verified version 1, neither the one they did not expect nor the flipped one;
    # the survivor verified version 5 in the new group.
    assert next(r[2] for r in reports if r[1] == "verified") == [2, 0, 0, 1], reports
    error = next(text for _, what, text in reports if what == "error")
    assert re.search(r"Connection (closed by peer|reset)", error) and error.endswith("(group left: True)"), error


def test_a_receive_before_the_replica_joined_a_group_is_refused_and_loads_nothing():
    loads = []
    receiver = LocalReceiver(torch.device("cpu"), lambda weights, version: loads.append(version))
    with pytest.raises(RuntimeError, match="weights version 3: this replica has not joined a weight group"):
        receiver.receive(3)
    assert loads == [] and receiver.buffer_receiver is None


def test_a_vllm_receiver_reaches_every_tp_worker_and_loads_inside_the_engines_load_context():
    """The calls a vLLM engine's receiver makes (its NCCL run is on the GPU machines): each one a
    `collective_rpc` over the TP workers, the first worker's timings returned, and the load alone
    inside the engine's context for a weight load, entered with the new version."""
    events = []

    class Engine:
        def collective_rpc(self, method, args=()):
            events.append((method, args))
            return [{"worker": 0}, {"worker": 1}] if method is not worker_join else [1, 2]

    @contextlib.contextmanager
    def loading(version):
        events.append(("loading", version))
        yield
        events.append(("loaded", version))

    receiver = VLLMReceiver(Engine(), loading)
    assert receiver.join("10.0.0.1", 29500, 1, 3, "layout") == [1, 2]
    assert receiver.receive(4) == {"worker": 0}
    assert receiver.load(4) == {"worker": 0}
    assert events == [(worker_join, ("10.0.0.1", 29500, 1, 3, "layout")), (worker_stage, (4,)),
                      ("loading", 4), (worker_load_staged, ()), ("loaded", 4)]


class _TwoMembers:
    """The object channel of a two-member group (vLLM's StatelessProcessGroup: `send_obj`,
    `recv_obj`), both ends in this process; `side(rank).group` is what a member's group holds."""

    def __init__(self):
        self.inboxes = {0: queue.Queue(), 1: queue.Queue()}

    def side(self, rank: int):
        inboxes = self.inboxes

        class Side:
            def send_obj(self, obj, dst):
                inboxes[dst].put(obj)

            def recv_obj(self, src):
                return inboxes[rank].get(timeout=5)

        return type("Group", (), {"group": Side()})()


def test_a_lone_receiver_lends_its_buffer_and_learns_whether_the_trainer_copies_into_it(monkeypatch):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    members = _TwoMembers()
    members.inboxes[1].put(True)  # the trainer's answer, waiting
    assert lend_buffer(members.side(1), torch.zeros(8)) is True
    host, (rebuild, args) = members.inboxes[0].get_nowait()
    assert host == socket.gethostname() and callable(rebuild) and args


def test_a_receiver_with_expandable_segments_offers_no_buffer(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    members = _TwoMembers()
    members.inboxes[1].put(False)  # the trainer's answer, waiting
    assert lend_buffer(members.side(1), torch.zeros(8)) is False
    assert members.inboxes[0].get_nowait() == (socket.gethostname(), None)


def test_a_buffer_not_offered_is_not_mapped_and_the_receiver_is_told_the_chunks_come_by_broadcast():
    members = _TwoMembers()
    members.inboxes[0].put((socket.gethostname(), None))  # the receiver's process grows expandable segments
    assert borrow_buffer(members.side(0), torch.device("cuda", 3)) is None
    assert members.inboxes[1].get_nowait() is False


@pytest.mark.parametrize("host, refused, borrowed", [
    ("another-host", False, False),  # not mapped at all: CUDA IPC is within one host
    (socket.gethostname(), True, False),  # CUDA IPC refused the handle
    (socket.gethostname(), False, True),
])
def test_the_trainer_copies_into_a_lent_buffer_only_where_it_can_map_it(host, refused, borrowed):
    calls = []

    def rebuild(*args):
        calls.append(args)
        if refused:
            raise RuntimeError("CUDA error: invalid resource handle")
        return "the receiver's buffer"

    members = _TwoMembers()
    members.inboxes[0].put((host, (rebuild, tuple(range(15)))))
    got = borrow_buffer(members.side(0), torch.device("cuda", 3))
    assert got == ("the receiver's buffer" if borrowed else None)
    assert members.inboxes[1].get_nowait() is borrowed  # the receiver is told which way the chunks come
    # Mapped on the trainer's own device, whatever index the receiver's process gave its GPU.
    assert calls == ([] if host == "another-host" else [(0, 1, 2, 3, 4, 5, 3, *range(7, 15))])
