"""Weight sync by broadcast: trainer rank 0 sends one packed buffer to every replica at once.

The group is vLLM's stateless NCCL group on GPUs, a gloo group of its own on CPU, beside the
trainer's torch.distributed world; the trainer is rank 0, replica r's TP worker t rank
1 + r * tp + t. A broadcast is the packed buffer in chunks, packed while the last is on the wire,
then a trailer (version, checksum), then every member's verdict summed over the group. On GPUs the
sender's whole send is one CUDA graph, and a lone receiver on the trainer's host takes the chunks
by the copy engine into a buffer it lends. Each engine names its receiving end
(`Engine.broadcast_receiver()`): `LocalReceiver` (native) or `VLLMReceiver` (per TP worker).
The whole protocol, groups and deaths included: docs/ARCHITECTURE.md, "Weight sync".
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from rlactors.lora.replica import load_adapters
from rlactors.procs.placement import expandable_segments
from rlactors.vllm_api import worker_model
from rlactors.weight_sync.checksum import ChecksumMismatch, RunningChecksum, unsigned
from rlactors.weight_sync.copy_plan import CopyPlan
from rlactors.weight_sync.packed import Chunk, PackedLayout
from rlactors.weight_sync.shared import rebuild_on

GLOO_TIMEOUT = datetime.timedelta(minutes=5)  # a rendezvous or broadcast that waits longer fails


class UnexpectedVersion(RuntimeError):
    """A broadcast carried another weights version than the receiver was told to expect."""


class BroadcastBroken(RuntimeError):
    """A broadcast that did not complete because its group broke (a member left it); the side
    that raises it has left the group, so the members waiting on it fail too."""


class GlooGroup:
    """A CPU broadcast group, with the calls of vLLM's PyNcclCommunicator that are used here."""

    def __init__(self, host: str, port: int, rank: int, world_size: int):
        import torch.distributed as dist

        store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=GLOO_TIMEOUT)
        self.group = dist.ProcessGroupGloo(store, rank, world_size, GLOO_TIMEOUT)

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        self._run(lambda group: group.broadcast(tensor, src))

    def all_reduce(self, in_tensor: torch.Tensor, out_tensor: torch.Tensor, stream: Any = None) -> torch.Tensor:
        """The sum over the group, in place: `out_tensor` must be `in_tensor`."""
        self._run(lambda group: group.allreduce([in_tensor]))
        return out_tensor

    def _run(self, collective: Callable[[Any], Any]) -> None:
        try:
            collective(self.group).wait()
        except RuntimeError as e:  # a member that died fails it at once (connection closed or reset)
            # Dropped here, so closed now whoever holds this wrapper (a traceback does): members
            # waiting on this one in the broadcast's next collective (a chunk, the trailer or the
            # verdicts) fail instead of waiting for GLOO_TIMEOUT.
            self.group = None
            raise BroadcastBroken(f"the weight broadcast group broke: {e}") from None


def broadcast_stream(device: torch.device) -> torch.cuda.Stream:
    """A stream of high priority for the broadcast: the GPU schedules its NCCL kernels before the
    blocks of the packing (or of the engine's step) queued beside them. Measured, it moved the
    receive within noise (benchmarks/results/notes/weight_sync.md)."""
    return torch.cuda.Stream(device, priority=-1)


def join_group(host: str, port: int, rank: int, world_size: int, device: torch.device) -> Any:
    """Joins the weight group as `rank`; blocks until all `world_size` members have joined."""
    if device.type == "cpu":
        return GlooGroup(host, port, rank, world_size)
    from rlactors.vllm_api import PyNcclCommunicator, StatelessProcessGroup

    group = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=world_size)
    return PyNcclCommunicator(group, device=device)


def _lends_buffer(world_size: int, device: torch.device) -> bool:
    """Whether a group of `world_size` on `device` starts with the lone receiver's `lend_buffer`
    and the trainer's `borrow_buffer`: both sides must agree, as each waits for the other."""
    return device.type == "cuda" and world_size == 2


def lend_buffer(group: Any, buffer: torch.Tensor) -> bool:
    """A one-receiver group's receiver, on GPU: offers its buffer to the trainer (rank 0) by CUDA
    IPC; returns whether the trainer copies the chunks into it (else they come by broadcast). None
    is offered where this process's allocator grows expandable segments (`expandable_segments:True`
    in PYTORCH_CUDA_ALLOC_CONF): the copy engine writes into a mapping of such memory at 2/3 of its
    speed, slower than NCCL (benchmarks/results/weight_sync.md)."""
    from torch.multiprocessing.reductions import reduce_tensor

    offer = None if expandable_segments() else reduce_tensor(buffer)
    group.group.send_obj((socket.gethostname(), offer), dst=0)
    return group.group.recv_obj(src=0)


def borrow_buffer(group: Any, device: torch.device) -> torch.Tensor | None:
    """The trainer's side of `lend_buffer`: the receiver's buffer mapped on `device`, or None
    where it cannot be (not offered, another host, or CUDA IPC refused); the receiver is told which."""
    host, offer = group.group.recv_obj(src=1)
    borrowed = None
    if offer is not None and host == socket.gethostname():
        try:
            borrowed = rebuild_on(offer, device.index)
        except RuntimeError:
            borrowed = None
    group.group.send_obj(borrowed is not None, dst=1)
    return borrowed


class WeightSender:
    """Trainer rank 0's side: a persistent send buffer and the pipelined broadcast of it.

    `pack(chunk, buffer)` writes a chunk's pieces of the current weights into the buffer. On GPU,
    with `capture`, a group's first send captures all of a send's GPU work (the packing, the
    chunks, the checksum, the trailer and the verdicts) in one CUDA graph, and every send replays
    it: one launch in place of ~10 host calls per chunk (benchmarks/results/weight_sync.md).
    `pack` must then enqueue the same GPU work at every call, reading weights that change in
    place, and no collective of another group (a trainer of several ranks gathers each chunk in
    its pack: it sends with `capture=False`)."""

    def __init__(self, layout: PackedLayout, device: torch.device, pack: Callable[[Chunk, torch.Tensor], None],
                 capture: bool = True):
        self.layout = layout
        self.pack = pack
        self.buffer = layout.empty(device).zero_()  # zeroed once: padding bytes count in the checksum
        self.group: Any = None
        self.receivers = 0  # the group's other members, each of which returns a verdict
        self.borrowed: torch.Tensor | None = None  # a lone receiver's buffer, written by the copy engine
        self.aborted = False
        self.graph: torch.cuda.CUDAGraph | None = None  # the group's send, captured at its first
        self.capture = capture and self.buffer.is_cuda
        if self.buffer.is_cuda:  # the broadcast, the copies and the checksum each beside the packing
            self.send_stream, self.checksum_stream = broadcast_stream(device), torch.cuda.Stream(device)
            self.copy_stream = torch.cuda.Stream(device)
            self.signal = torch.zeros(1, dtype=torch.int32, device=device)  # "receiving", "landed": value meaningless
            # The trailer, its version set at each send, and the verdicts: they cross streams, so
            # they are the sender's own, not freed while a send runs.
            self.version = torch.zeros(1, dtype=torch.int64, device=device)
            self.trailer = torch.zeros(3, dtype=torch.int64, device=device)
            self.verdicts = torch.zeros(1, dtype=torch.int32, device=device)
            # [version, plain sum, weighted sum, verdicts], written by the send's last copy: read
            # once it is done, with no transfer of its own.
            self.result = torch.zeros(4, dtype=torch.int64, pin_memory=True)
            # Recorded inside the graph when captured (external), so that they time each replay.
            self.started, self.packed, self.ended = (torch.cuda.Event(enable_timing=True, external=self.capture)
                                                     for _ in range(3))

    def join(self, host: str, port: int, world_size: int) -> None:
        """Forms a group (as its rank 0) in place of the previous one."""
        self._drop_graph()  # its collectives are the old group's, its copies into the old buffer
        self.group = None
        self.borrowed = None
        self.aborted = False
        self.group = join_group(host, port, 0, world_size, self.buffer.device)
        self.receivers = world_size - 1
        if _lends_buffer(world_size, self.buffer.device):
            self.borrowed = borrow_buffer(self.group, self.buffer.device)

    async def send(self, version: int) -> dict[str, Any]:
        """Packs the weights chunk by chunk and sends each chunk once packed, then the trailer:
        `version` and the checksum sums of the whole buffer, which every receiver checks its own
        against, then sums the receivers' verdicts. On GPU the packing (the caller's stream), the
        chunks' transfer and the checksum run on streams of their own, so packing chunk k + 1
        overlaps sending chunk k, and the checksum of the packed buffer overlaps sending the last
        chunks. BroadcastBroken if a member left the group or `abort` gave it up: the group is
        left, and a new one must be joined. Returns the version, the checksum's digest, how many
        of the `receivers` verified it, the bytes, whether the chunks went by copy engine (1.0) or
        broadcast, seconds (the whole send; its span on the device, from the first packing to the
        last collective, the rest being the host's; and the packing within it), and the wall clock
        (`time.time()`) at its start and end, which the push compares across processes."""
        started_at, start = time.time(), time.perf_counter()
        try:
            if self.buffer.is_cuda:
                (_, plain, weighted, verified), device_s, pack_s = await self._send_cuda(version)
            else:
                (_, plain, weighted, verified), device_s, pack_s = self._send_cpu(version)
        except BaseException:  # a member left, or the packing failed halfway through the broadcast
            self.group = None  # over gloo this closes its connections: the members waiting on it fail
            raise
        return {"version": version, "checksum": self.layout.digest(*unsigned(plain, weighted)),
                "verified": verified, "receivers": self.receivers, "bytes": float(self.layout.total_bytes),
                "copy_engine": float(self.borrowed is not None), "send_s": time.perf_counter() - start,
                "send_device_s": device_s, "pack_s": pack_s, "started_at": started_at, "ended_at": time.time()}

    def _send_cpu(self, version: int) -> tuple[list[int], float, float]:
        began, pack_s = time.perf_counter(), 0.0  # on CPU the host is the device
        for chunk in self.layout.chunks:
            packing = time.perf_counter()
            self.pack(chunk, self.buffer)
            pack_s += time.perf_counter() - packing
            self.group.broadcast(self.layout.chunk_view(self.buffer, chunk), src=0)
        trailer = _trailer(torch.tensor([version]), self.buffer)
        self.group.broadcast(trailer, src=0)
        verdicts = torch.zeros(1, dtype=torch.int32)  # the receivers' verdicts; the sender's own counts nothing
        self.group.all_reduce(verdicts, verdicts)
        return trailer.tolist() + [int(verdicts.item())], time.perf_counter() - began, pack_s

    async def _send_cuda(self, version: int) -> tuple[list[int], float, float]:
        # NCCL waits for a dead member for ever, and a host thread blocked in that wait could not
        # serve `abort`: everything is enqueued, and the end of the broadcast polled.
        self.version.fill_(version)
        if not self.capture:
            self._enqueue()
        else:
            if self.graph is None:
                self.graph = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                        self._enqueue()
                except BaseException:
                    self._drop_graph()  # half captured, it may hold the group's communicator
                    raise
            self.graph.replay()
        done = torch.cuda.current_stream().record_event()
        # Polled between the event loop's other work, not slept between: asyncio's selector waits
        # in whole milliseconds, so any sleep here would add up to a millisecond to every sync.
        while not done.query():
            if self.aborted:
                raise BroadcastBroken("the weight broadcast was aborted: a member died during it")
            await asyncio.sleep(0)
        return (self.result.tolist(), self.started.elapsed_time(self.ended) / 1e3,
                self.started.elapsed_time(self.packed) / 1e3)

    def _enqueue(self) -> None:
        """A whole send on the sender's streams, after the current stream's work (which holds the
        version), joined back into it at the end: run as it is enqueued, or captured."""
        packing = torch.cuda.current_stream()
        sides = (self.send_stream, self.copy_stream, self.checksum_stream)
        for stream in sides:
            stream.wait_stream(packing)
        try:
            self._enqueue_send(packing)
        finally:  # a capture ends only once every stream it forked is joined back, a failed one too
            for stream in sides:
                packing.wait_stream(stream)
        self.ended.record(packing)

    def _enqueue_send(self, packing: torch.cuda.Stream) -> None:
        self.started.record(packing)
        chunks = self.layout.chunks
        self.pack(chunks[0], self.buffer)  # before the collective below, which the packing need not wait for
        if self.borrowed is not None:
            # Only a receiver that is receiving may be written into (it may still be loading
            # the last version from its buffer): all of the group in one collective says so.
            self.group.all_reduce(self.signal, self.signal, stream=self.send_stream)
            self.copy_stream.wait_stream(self.send_stream)
        for i, chunk in enumerate(chunks):
            if i:  # chunk 0 was packed above
                self.pack(chunk, self.buffer)
            ready = packing.record_event()
            view = self.layout.chunk_view(self.buffer, chunk)
            if self.borrowed is None:
                self.send_stream.wait_event(ready)
                self.group.broadcast(view, src=0, stream=self.send_stream)
                continue
            self.copy_stream.wait_event(ready)
            with torch.cuda.stream(self.copy_stream):
                self.layout.chunk_view(self.borrowed, chunk).copy_(view, non_blocking=True)
            self.send_stream.wait_stream(self.copy_stream)
            self.group.broadcast(self.signal, src=0, stream=self.send_stream)
        self.packed.record(packing)
        self.checksum_stream.wait_stream(packing)
        with torch.cuda.stream(self.checksum_stream):
            self.trailer.copy_(_trailer(self.version, self.buffer))
        self.send_stream.wait_stream(self.checksum_stream)
        self.group.broadcast(self.trailer, src=0, stream=self.send_stream)
        with torch.cuda.stream(self.send_stream):
            self.verdicts.zero_()  # the sender's own verdict counts nothing
        self.group.all_reduce(self.verdicts, self.verdicts, stream=self.send_stream)
        with torch.cuda.stream(self.send_stream):
            self.result.copy_(torch.cat([self.trailer, self.verdicts.to(torch.int64)]), non_blocking=True)

    def abort(self) -> None:
        """Gives up a broadcast that waits for a dead member: NCCL's communicator is aborted
        (ncclCommAbort), and the broadcast raises BroadcastBroken. The group is left either way."""
        self.aborted = True
        # NCCL's abort waits until every CUDA graph that holds the communicator is destroyed (one
        # still running is freed once the abort has ended it).
        self._drop_graph()
        group, self.group = self.group, None
        if group is not None and self.buffer.is_cuda:
            group.nccl.ncclCommAbort(group.comm)

    def _drop_graph(self) -> None:
        if self.graph is not None:
            self.graph.reset()  # destroyed now, whatever still refers to it
            self.graph = None


def _trailer(version: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """What follows the chunks: [version, plain sum, weighted sum] of the packed `buffer`'s
    checksum, int64 on its device (`version`: [1] int64 there), computed on the current stream
    in one pass."""
    running = RunningChecksum(buffer.device)
    running.add(buffer, 0)
    return torch.cat([version, running.sums_tensor()])


class BufferReceiver:
    """A replica's side (the native engine holds one, each vLLM TP worker one): its member of the
    group and a receive buffer of its own, so a broadcast never touches the weights being served."""

    def __init__(self, layout: PackedLayout, device: torch.device):
        self.layout = layout
        self.buffer = layout.empty(device)
        self.group: Any = None
        self.lent = False  # whether the sender copies the chunks into the buffer (a lone receiver on GPU)
        self.checksum_stream = torch.cuda.Stream(device) if self.buffer.is_cuda else None
        self.signal = torch.zeros(1, dtype=torch.int32, device=device)  # "receiving", "landed": value meaningless

    def join(self, host: str, port: int, rank: int, world_size: int) -> None:
        """Joins a group in place of the previous one; the buffer, and what it holds, stay."""
        self.group = None
        self.group = join_group(host, port, rank, world_size, self.buffer.device)
        self.lent = _lends_buffer(world_size, self.buffer.device) and lend_buffer(self.group, self.buffer)

    def receive(self, version: int, stream: Any = None) -> dict[str, float]:
        """Receives the next broadcast into the buffer, chunk by chunk, checksumming each chunk
        as it lands (on GPU on a stream of its own, beside the receive on `stream`), then the
        trailer: the broadcast must carry `version` (else UnexpectedVersion) and its checksum
        must equal the trailer's (else ChecksumMismatch); either way its verdict goes to the
        sender first. BroadcastBroken when the group broke, which is then left. Returns the
        seconds it took, and the wall clock (`time.time()`) at its start and end."""
        started_at, start = time.time(), time.perf_counter()
        cuda = self.buffer.is_cuda
        stream = stream or (torch.cuda.current_stream() if cuda else None)
        running = RunningChecksum(self.buffer.device)
        trailer = torch.empty(3, dtype=torch.int64, device=self.buffer.device)
        try:
            if self.lent:  # the sender writes into the buffer once this says it may (WeightSender)
                self.group.all_reduce(self.signal, self.signal, stream=stream)
            for chunk in self.layout.chunks:
                view = self.layout.chunk_view(self.buffer, chunk)
                # Lent, the chunk is copied in by the sender, which then says it landed.
                self.group.broadcast(self.signal if self.lent else view, src=0, stream=stream)
                if cuda:
                    self.checksum_stream.wait_event(stream.record_event())
                    with torch.cuda.stream(self.checksum_stream):
                        running.add(view, chunk.start)
                else:
                    running.add(view, chunk.start)
            self.group.broadcast(trailer, src=0, stream=stream)
            # The verdict is reached on the device, so the trainer waits for no host round trip.
            if cuda:
                stream.wait_stream(self.checksum_stream)
            with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                received = running.sums_tensor()
                verified = (trailer[0] == version) & (trailer[1:] == received).all()
                verdict = verified.to(torch.int32).reshape(1)
            self.group.all_reduce(verdict, verdict, stream=stream)
        except BroadcastBroken:
            self.group = None  # as the sender does: the members waiting on this one fail too
            raise
        if cuda:
            stream.synchronize()  # the verdict is out before the group can be left
        sent_version, *sent = trailer.tolist()
        received, sent = unsigned(*received.tolist()), unsigned(*sent)
        if sent_version != version:
            raise UnexpectedVersion(f"weights version {version} expected, the broadcast carried version "
                                    f"{sent_version}; keeping the previous weights")
        if received != sent:
            raise ChecksumMismatch(f"weights version {version}: received checksum {self.layout.digest(*received)}, "
                                   f"trainer sent {self.layout.digest(*sent)}; keeping the previous weights")
        return {"receive_verify_s": time.perf_counter() - start, "started_at": started_at, "ended_at": time.time()}

    def weights(self) -> dict[str, torch.Tensor]:
        """The received tensors: views into the buffer, valid until the next receive."""
        return dict(self.layout.views(self.buffer))


class BroadcastReceiver(Protocol):
    """An engine's receiving end of the weight broadcast."""

    def join(self, host: str, port: int, rank_offset: int, world_size: int, layout: PackedLayout) -> list[int]:
        """Joins a (new) group, keeping the receive buffer; blocks until every member joins.
        Returns the ranks taken (one per TP worker, from `rank_offset` on)."""

    def receive(self, version: int) -> dict[str, float]:
        """Receives the next broadcast, which must carry `version`, into the buffer and checks
        its checksum against the one it carries (ChecksumMismatch on a difference); the served
        weights are untouched. Returns timings."""

    def load(self, version: int) -> dict[str, float]:
        """Loads the received weights into the model; later tokens carry `version`. Returns timings."""


class LocalReceiver:
    """The receiving end in the engine's own process (the native engine): a BufferReceiver on
    the engine's device, made at the first join; a load is the engine's own `load_weights` from
    the buffer's views."""

    def __init__(self, device: torch.device, load_weights: Callable[[Mapping[str, torch.Tensor], int], None]):
        self.device = device
        self.load_weights = load_weights
        self.buffer_receiver: BufferReceiver | None = None

    def join(self, host: str, port: int, rank_offset: int, world_size: int, layout: PackedLayout) -> list[int]:
        if self.buffer_receiver is None:
            self.buffer_receiver = BufferReceiver(layout, self.device)
        self.buffer_receiver.join(host, port, rank_offset, world_size)
        return [rank_offset]

    def receive(self, version: int) -> dict[str, float]:
        if self.buffer_receiver is None:
            raise RuntimeError(f"weights version {version}: this replica has not joined a weight group")
        return self.buffer_receiver.receive(version)

    def load(self, version: int) -> dict[str, float]:
        start = time.perf_counter()
        self.load_weights(self.buffer_receiver.weights(), version)
        return {"load_s": time.perf_counter() - start}


class VLLMReceiver:
    """The receiving end in a vLLM engine: a BufferReceiver in each TP worker, reached through
    `collective_rpc` (the worker functions below); the load runs inside `loading(version)`, the
    engine's context for a weight load (`VLLMEngine._loading`). With `lora_scale` (alpha / r)
    the broadcast carries LoRA adapters, which each worker merges into its base
    (rlactors.lora.replica)."""

    def __init__(self, llm_engine: Any, loading: Callable[[int], contextlib.AbstractContextManager[None]],
                 lora_scale: float | None = None):
        self.llm_engine = llm_engine
        self.loading = loading
        self.lora_scale = lora_scale

    def join(self, host: str, port: int, rank_offset: int, world_size: int, layout: PackedLayout) -> list[int]:
        return self.llm_engine.collective_rpc(worker_join, args=(host, port, rank_offset, world_size, layout))

    def receive(self, version: int) -> dict[str, float]:
        return self.llm_engine.collective_rpc(worker_stage, args=(version,))[0]

    def load(self, version: int) -> dict[str, float]:
        args = () if self.lora_scale is None else (self.lora_scale,)
        with self.loading(version):
            return self.llm_engine.collective_rpc(worker_load_staged, args=args)[0]


# -- vLLM worker side: run through LLM.collective_rpc, `worker` is vLLM's worker object ----------


def worker_join(worker: Any, host: str, port: int, rank_offset: int, world_size: int, layout: PackedLayout) -> int:
    """Joins a (new) weight group; the worker's receive buffer is made at the first join only."""
    rank = rank_offset + worker.rank
    if getattr(worker, "rlactors_receiver", None) is None:
        device = torch.device("cuda", torch.cuda.current_device())
        worker.rlactors_receiver = BufferReceiver(layout, device)
        worker.rlactors_stage_stream = broadcast_stream(device)  # receives beside the engine's work
    worker.rlactors_receiver.join(host, port, rank, world_size)
    return rank


def worker_stage(worker: Any, version: int) -> dict[str, float]:
    """Receives the broadcast into the worker's buffer and checks its checksum; the model's
    weights are untouched, so the engine may be generating meanwhile (on its own stream)."""
    stream: torch.cuda.Stream = worker.rlactors_stage_stream
    with torch.cuda.stream(stream):
        return worker.rlactors_receiver.receive(version, stream)


def worker_load_staged(worker: Any, lora_scale: float | None = None) -> dict[str, float]:
    """Loads the verified buffer into the model. The first load goes through vLLM's
    `load_weights` and derives the copy plan (rlactors.weight_sync.copy_plan) that later loads
    use where it was proven equal. With `lora_scale` the buffer holds adapters, merged into the
    model's base (rlactors.lora.replica)."""
    receiver: BufferReceiver = worker.rlactors_receiver
    layout, buffer = receiver.layout, receiver.buffer
    start = time.perf_counter()
    plan = getattr(worker, "rlactors_copy_plan", None)
    if lora_scale is not None:
        load_adapters(worker_model(worker), layout.views(buffer), lora_scale)
    elif plan is not None:
        plan.apply()
    else:
        model = worker_model(worker)
        model.load_weights(layout.views(buffer))
        if not hasattr(worker, "rlactors_copy_plan"):
            worker.rlactors_copy_plan = CopyPlan.derive(model, layout, buffer)
    if buffer.is_cuda:
        torch.cuda.current_stream().synchronize()  # the buffer may be overwritten by the next broadcast
    return {"load_s": time.perf_counter() - start, "copy_plan": float(plan is not None)}
