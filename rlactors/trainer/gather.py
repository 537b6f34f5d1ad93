"""Rows of the policy's parameters, gathered from the trainer ranks into rank 0's tensors.

A request is a list of parts (parameter name, first row, rows) and, on rank 0, a destination
tensor per part. Each rank casts the rows it holds of each part (unless a lower rank holds them
too: the experts' replicas under expert parallelism) into a flat buffer with one slot per part,
sized for the most rows any rank sends of it, so that every rank's buffer has the same layout;
one gather of the buffers as bytes (any dtype, on gloo too) brings them to rank 0, which copies
each rank's rows into place. On one rank the rows are copied into the destination directly. (A
`full_tensor()` per parameter would be hundreds of collectives and allocations.)

A `RowGather` is planned once and run as often as the parameters change: its views of the
parameters' rows, the slots and the destination stay valid while the parameters are written in
place (optimizer steps, checkpoint loads). Making them costs more host time than a GPU takes to
copy the rows, so the weight sync plans one per chunk of its send buffer, all over one pair of
buffers, and runs them at each sync.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from rlactors.trainer.parallel import held_rows, local_rows
from rlactors.weight_sync.packed import PackedLayout

Part = tuple[str, int, int]  # parameter name, first row, rows


@dataclass(frozen=True)
class Slots:
    """Where each part's rows travel: per part, the rows ``[lo, hi)`` each rank sends of it and
    its offset in the flat buffer; ``size`` elements in all."""

    sent: list[list[tuple[int, int]]]
    offsets: list[int]
    size: int


def plan_slots(params: Mapping[str, nn.Parameter], parts: Sequence[Part]) -> Slots:
    sent, offsets, size = [], [], 0
    for name, first, rows in parts:
        held = held_rows(params[name])
        # Each row from the first rank that holds it (the experts' replicas hold the same rows).
        sent.append([_overlap(first, rows, *held[r]) if held.index(held[r]) == r else (first, first)
                     for r in range(len(held))])
        offsets.append(size)
        size += max(hi - lo for lo, hi in sent[-1]) * math.prod(params[name].shape[1:])
    return Slots(sent, offsets, size)


class RowGather:
    """One planned gather of ``parts`` into ``destination(i)`` for part ``i`` (on rank 0; None on
    the other ranks), cast to ``dtype``. With more than one rank, ``flat`` (``slots.size``
    elements of ``dtype``) is this rank's buffer and, on rank 0, ``gathered`` every rank's; they
    may be views of larger buffers that other gathers use too. ``run`` is a collective."""

    def __init__(self, params: Mapping[str, nn.Parameter], parts: Sequence[Part],
                 destination: Callable[[int], torch.Tensor] | None, slots: Slots | None = None,
                 flat: torch.Tensor | None = None, gathered: list[torch.Tensor] | None = None):
        shards = [local_rows(params[name]) for name, _, _ in parts]
        if dist.get_world_size() == 1:
            self.rows = [local.detach()[first:first + rows] for (local, _), (_, first, rows) in zip(shards, parts)]
            self.into = [destination(i) for i in range(len(parts))]
            self.flat = None
            return
        rank = dist.get_rank()
        self.rows, self.into = [], []
        for (local, local_first), rank_sent, offset in zip(shards, slots.sent, slots.offsets):
            lo, hi = rank_sent[rank]
            self.rows.append(local.detach()[lo - local_first:hi - local_first])
            self.into.append(flat[offset:offset + self.rows[-1].numel()].view(self.rows[-1].shape))
        self.flat = flat.view(torch.uint8)
        self.gathered = None if gathered is None else [g.view(torch.uint8) for g in gathered]
        self.targets, self.sources = [], []  # rank 0: each rank's rows of each part into place
        if destination is None:
            return
        for i, ((name, first, _), rank_sent, offset) in enumerate(zip(parts, slots.sent, slots.offsets)):
            shape = params[name].shape
            for (lo, hi), rank_flat in zip(rank_sent, gathered):
                if hi > lo:
                    self.targets.append(destination(i)[lo - first:hi - first])
                    self.sources.append(rank_flat[offset:offset + (hi - lo) * math.prod(shape[1:])]
                                        .view(hi - lo, *shape[1:]))

    @torch.no_grad()
    def run(self) -> None:
        torch._foreach_copy_(self.into, self.rows)
        if self.flat is None:
            return
        dist.gather(self.flat, self.gathered, dst=0)
        if self.targets:
            torch._foreach_copy_(self.targets, self.sources)


# Rows gathered at once where the whole policy goes to host memory (`PolicyTrainerCore.full_weights`).
GATHER_CHUNK_BYTES = 512 << 20


def row_chunks(params: Mapping[str, nn.Parameter], itemsize: int, chunk_bytes: int) -> list[list[Part]]:
    """The parameters' rows, in order, as chunks of parts (name, first row, rows) of at most
    `chunk_bytes` at `itemsize` bytes an element (one row at least)."""
    chunks, chunk, size = [], [], 0
    for name, p in params.items():
        row_bytes = itemsize * math.prod(p.shape[1:])
        first = 0
        while first < p.shape[0]:
            if size + row_bytes > chunk_bytes and chunk:
                chunks.append(chunk)
                chunk, size = [], 0
            rows = min(p.shape[0] - first, max(1, (chunk_bytes - size) // row_bytes))
            chunk.append((name, first, rows))
            first, size = first + rows, size + rows * row_bytes
    return chunks + ([chunk] if chunk else [])


def plan_chunked(params: Mapping[str, nn.Parameter], chunks: Sequence[Sequence[Part]], dtype: torch.dtype,
                 destinations: Sequence[Callable[[int], torch.Tensor]] | None,
                 device: torch.device) -> list[RowGather]:
    """One `RowGather` per chunk of parts (into ``destinations[c]`` on rank 0, None elsewhere),
    all over one pair of buffers sized for the largest chunk: the chunks run one after another
    on one stream."""
    targets = destinations or [None] * len(chunks)
    if dist.get_world_size() == 1:
        return [RowGather(params, parts, into) for parts, into in zip(chunks, targets)]
    slots = [plan_slots(params, parts) for parts in chunks]
    flat = torch.empty(max(s.size for s in slots), dtype=dtype, device=device)
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())] if dist.get_rank() == 0 else None
    return [RowGather(params, parts, into, s, flat[:s.size], gathered and [g[:s.size] for g in gathered])
            for parts, into, s in zip(chunks, targets, slots)]


def plan_packing(params: Mapping[str, nn.Parameter], layout: PackedLayout, dtype: torch.dtype,
                 buffer: torch.Tensor | None, device: torch.device) -> dict[int, RowGather]:
    """The weight sync's packing (rlactors.weight_sync.packed): each chunk of `layout` into
    `buffer` (rank 0's send buffer; None on the other ranks) is one planned gather of its pieces'
    rows (`plan_chunked`), by the chunk's start; the views are made once, here, not at every sync."""
    chunks = layout.chunks
    pieces = [[(p.name, p.first_row, p.rows) for p in chunk.pieces] for chunk in chunks]
    destinations = None if buffer is None else [
        lambda i, chunk=chunk: layout.piece_view(buffer, chunk.pieces[i]) for chunk in chunks]
    gathers = plan_chunked(params, pieces, dtype, destinations, device)
    return {chunk.start: gather for chunk, gather in zip(chunks, gathers)}


def _overlap(first: int, rows: int, held_first: int, held: int) -> tuple[int, int]:
    """The rows `[lo, hi)` that rows `first` to `first + rows` share with rows `held_first` to
    `held_first + held` (`lo == hi` when none)."""
    lo = max(first, held_first)
    return lo, max(lo, min(first + rows, held_first + held))
