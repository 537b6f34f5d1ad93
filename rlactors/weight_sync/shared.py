"""Weight sync through one buffer shared by the trainer and the replicas on its host.

Trainer rank 0 packs the policy into a `SharedBuffer` (the broadcast's `PackedLayout`) and
checksums it; each replica maps that buffer once (`SharedReceiver`) and, at each push, checks the
checksum on its mapping and loads from its views, so a push moves only (version, checksum) by
message. On GPU the buffer goes by CUDA IPC; on CPU it is a memfd, opened by the replicas through
/proc/<pid>/fd: anonymous memory that the kernel frees with its last process, however they end.
The trainer repacks only after every replica has loaded the last version
(rlactors.weight_sync.sync.SharedSync). The protocol: docs/ARCHITECTURE.md, "Weight sync".
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from rlactors.procs.placement import expandable_segments, set_expandable_segments
from rlactors.weight_sync.checksum import ChecksumMismatch
from rlactors.weight_sync.packed import PackedLayout


@dataclass(frozen=True)
class SharedHandle:
    """What a replica needs to map the trainer's buffer: its host, layout and owner, and either
    torch's CUDA IPC reduction of it (`cuda`) or the owner's memfd (`fd`)."""

    host: str
    pid: int
    layout: PackedLayout
    cuda: tuple[Any, tuple] | None = None
    fd: int | None = None


class SharedBuffer:
    """Trainer rank 0's buffer, zeroed once (padding counts in the checksum), and its handle."""

    def __init__(self, layout: PackedLayout, device: torch.device):
        self.layout = layout
        if device.type == "cuda":
            from torch.multiprocessing.reductions import reduce_tensor

            with _plain_segments():
                self.buffer = layout.empty(device).zero_()
            self.handle = SharedHandle(socket.gethostname(), os.getpid(), layout, cuda=reduce_tensor(self.buffer))
        else:
            self._fd = os.memfd_create("rlactors-weights", os.MFD_CLOEXEC)
            os.ftruncate(self._fd, max(layout.total_bytes, 1))  # a memfd reads as zeros
            self._map = mmap.mmap(self._fd, max(layout.total_bytes, 1))
            self.buffer = torch.frombuffer(self._map, dtype=torch.uint8)[:layout.total_bytes]
            self.handle = SharedHandle(socket.gethostname(), os.getpid(), layout, fd=self._fd)


class SharedReceiver:
    """A replica's mapping of the trainer's buffer, made at the first handle it is given and
    again for a handle of another buffer (a new trainer)."""

    def __init__(self):
        self.handle: SharedHandle | None = None
        self.buffer: torch.Tensor | None = None

    def verified_views(self, handle: SharedHandle, version: int, checksum: str) -> dict[str, torch.Tensor]:
        """The buffer's tensors (views, no copies) once its checksum equals `checksum`, the
        trainer's of `version` (else ChecksumMismatch; nothing is loaded)."""
        if handle != self.handle:
            self.buffer, self.handle = map_buffer(handle), handle
        received = handle.layout.checksum(self.buffer)
        if received != checksum:
            raise ChecksumMismatch(f"weights version {version}: shared buffer checksum {received}, trainer "
                                   f"sent {checksum}; keeping the previous weights")
        return dict(handle.layout.views(self.buffer))


def map_buffer(handle: SharedHandle) -> torch.Tensor:
    """The trainer's buffer mapped into this process: by CUDA IPC onto this process's current
    device (whatever index its CUDA_VISIBLE_DEVICES gives the GPU), or the memfd; RuntimeError
    from another host."""
    if handle.host != socket.gethostname():
        raise RuntimeError(f"the trainer's weight buffer is on host {handle.host}, this replica on "
                           f"{socket.gethostname()}: shared weight sync needs one host")
    if handle.cuda is not None:
        return rebuild_on(handle.cuda, torch.cuda.current_device())
    size = max(handle.layout.total_bytes, 1)
    fd = os.open(f"/proc/{handle.pid}/fd/{handle.fd}", os.O_RDWR)  # writable: torch maps no read-only buffer
    try:
        mapped = mmap.mmap(fd, size)
    finally:
        os.close(fd)  # the mapping keeps the memory
    return torch.frombuffer(mapped, dtype=torch.uint8)[:handle.layout.total_bytes]


def rebuild_on(reduced: tuple[Any, tuple], device_index: int) -> torch.Tensor:
    """A CUDA tensor of another process (torch's `reduce_tensor` of it) mapped by CUDA IPC onto
    this process's `device_index`, whatever index the owner's CUDA_VISIBLE_DEVICES gave the GPU."""
    rebuild, args = reduced
    return rebuild(*args[:6], device_index, *args[7:])


@contextlib.contextmanager
def _plain_segments() -> Iterator[None]:
    """Allocates without expandable segments meanwhile: their memory goes by CUDA IPC only
    through file descriptors that another process must be allowed to take (ptrace rights)."""
    expandable = expandable_segments()
    if expandable:
        set_expandable_segments(False)
    try:
        yield
    finally:
        if expandable:
            set_expandable_segments(True)
