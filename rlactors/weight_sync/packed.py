"""One flat byte buffer for a whole weight set: the unit of a GPU weight broadcast.

Broadcasting one buffer instead of hundreds of tensors keeps NCCL at full bandwidth, and one
checksum over the buffer (plus the layout) verifies everything a replica received. The buffer is
sent in chunks of about CHUNK_BYTES, cut at row boundaries (a large embedding spans several), so
that the sender packs chunk k + 1 while chunk k is on the wire, and a receiver checksums each chunk
as soon as it lands; every member derives the same chunks from the layout.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from rlactors.weight_sync.checksum import tensor_checksum

_ALIGN = 64  # bytes; every view starts aligned for any dtype
# Long enough that each broadcast's fixed cost is small, short enough to pipeline: much smaller
# chunks leave the host behind the GPUs, and 128 and 256 MiB tie (benchmarks/results/weight_sync_data_path.md).
CHUNK_BYTES = 256 << 20


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # torch dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int  # bytes into the buffer

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def nbytes(self) -> int:
        count = 1
        for d in self.shape:
            count *= d
        return count * self.torch_dtype.itemsize

    @property
    def rows(self) -> int:
        """Along dim 0, as FSDP shards it; a tensor of no dimension is one row."""
        return self.shape[0] if self.shape else 1

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.rows if self.rows else 0


@dataclass(frozen=True)
class Piece:
    """Rows `first_row` to `first_row + rows` (along dim 0) of the tensor named `name`."""

    name: str
    first_row: int
    rows: int


@dataclass(frozen=True)
class Chunk:
    """Bytes `start` to `end` of the buffer: the pieces that fill them, and the padding after."""

    start: int
    end: int
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class PackedLayout:
    specs: tuple[TensorSpec, ...]
    total_bytes: int
    chunks: tuple[Chunk, ...]  # cover the buffer, in order

    @classmethod
    def of(cls, named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
           chunk_bytes: int = CHUNK_BYTES) -> PackedLayout:
        """The layout of `named` (name order kept; only shapes and dtypes are read), sent in
        chunks of at most `chunk_bytes` (or one row, where a row is longer)."""
        items = named.items() if isinstance(named, Mapping) else named
        specs, offset = [], 0
        for name, tensor in items:
            spec = TensorSpec(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset)
            specs.append(spec)
            offset += -(-spec.nbytes // _ALIGN) * _ALIGN
        return cls(tuple(specs), offset, _chunks(specs, offset, chunk_bytes))

    def empty(self, device: torch.device | str) -> torch.Tensor:
        return torch.empty(self.total_bytes, dtype=torch.uint8, device=device)

    def views(self, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) views into `buffer`, no copies."""
        if buffer.dtype != torch.uint8 or buffer.numel() != self.total_bytes:
            raise ValueError(f"buffer must be {self.total_bytes} uint8 bytes, got {buffer.numel()} {buffer.dtype}")
        return [(s.name, buffer[s.offset:s.offset + s.nbytes].view(s.torch_dtype).view(s.shape)) for s in self.specs]

    def pack(self, named: Mapping[str, torch.Tensor], buffer: torch.Tensor) -> torch.Tensor:
        """Copies every tensor of `named` into its place in `buffer`; returns the buffer."""
        if set(named) != {s.name for s in self.specs}:
            missing = sorted({s.name for s in self.specs} - set(named))
            extra = sorted(set(named) - {s.name for s in self.specs})
            raise ValueError(f"weights do not match the layout: missing {missing}, unexpected {extra}")
        for name, view in self.views(buffer):
            source = named[name]
            if tuple(source.shape) != tuple(view.shape) or source.dtype != view.dtype:
                raise ValueError(f"{name}: {tuple(source.shape)} {source.dtype}, layout has "
                                 f"{tuple(view.shape)} {view.dtype}")
            view.copy_(source)
        return buffer

    def chunk_view(self, buffer: torch.Tensor, chunk: Chunk) -> torch.Tensor:
        return buffer[chunk.start:chunk.end]

    def piece_view(self, buffer: torch.Tensor, piece: Piece) -> torch.Tensor:
        """The rows of `piece` in `buffer`, in the tensor's dtype and shape."""
        spec = self.spec(piece.name)
        start = spec.offset + piece.first_row * spec.row_bytes
        view = buffer[start:start + piece.rows * spec.row_bytes].view(spec.torch_dtype)
        return view.view(piece.rows, *spec.shape[1:]) if spec.shape else view.view(())

    def spec(self, name: str) -> TensorSpec:
        return self._by_name[name]

    @functools.cached_property
    def _by_name(self) -> dict[str, TensorSpec]:
        return {s.name: s for s in self.specs}

    def checksum(self, buffer: torch.Tensor) -> str:
        """Digest of the layout and the buffer's bytes (padding included, so zero it once)."""
        return self.digest(*tensor_checksum(buffer))

    def digest(self, plain: int, weighted: int) -> str:
        """`checksum`'s digest from the buffer's (plain, weighted) sums (`RunningChecksum`)."""
        return hashlib.blake2b(f"{self._text}\n{plain:016x}{weighted:016x}".encode(), digest_size=16).hexdigest()

    @functools.cached_property
    def _text(self) -> str:
        # Made once: a sender digests every broadcast before it answers, and rebuilding the text of
        # a model's hundreds of tensors each time costs a measurable share of a fast push.
        return "\n".join(f"{s.name}:{s.dtype}:{s.shape}:{s.offset}" for s in self.specs)


def _chunks(specs: list[TensorSpec], total_bytes: int, chunk_bytes: int) -> tuple[Chunk, ...]:
    """Consecutive chunks of at most `chunk_bytes` (at least one row each), cut between rows.
    A tensor is cut only where its rows are whole multiples of the alignment, so every chunk
    starts aligned; the padding after a tensor goes with its last rows."""
    chunks: list[Chunk] = []
    start, pieces = 0, []
    for spec, next_offset in zip(specs, [s.offset for s in specs[1:]] + [total_bytes]):
        splittable = spec.row_bytes % _ALIGN == 0 and spec.row_bytes > 0
        row = 0
        while row < spec.rows:
            room = chunk_bytes - (spec.offset + row * spec.row_bytes - start)
            rows = spec.rows - row if not splittable else min(spec.rows - row, max(room, 0) // spec.row_bytes)
            if rows == 0 and pieces:  # the chunk is full: cut before this row
                chunks.append(Chunk(start, spec.offset + row * spec.row_bytes, tuple(pieces)))
                start, pieces = spec.offset + row * spec.row_bytes, []
                continue
            rows = max(rows, 1)
            pieces.append(Piece(spec.name, row, rows))
            row += rows
        if next_offset - start >= chunk_bytes or spec is specs[-1]:
            chunks.append(Chunk(start, next_offset, tuple(pieces)))
            start, pieces = next_offset, []
    return tuple(chunks)
