"""Checksums of weight sets, equal on CPU and GPU, used to verify every weight sync.

A tensor's bytes are read as 32-bit words and summed into PERIOD columns (word i into column
i % PERIOD) in one pass, in int32: integer sums wrap the same way in any reduction order and on
any device. The column sums are then reduced exactly in int64 to a plain sum and a
column-weighted sum. Every result stays on the device until one transfer per call, so a state of
hundreds of tensors costs one host sync. It detects any change within one 32-bit word, a swap of
unequal words in different columns (PERIOD is prime, so distances built from powers of two are
not multiples of it), and unequal tensors swapped between names; why: docs/ARCHITECTURE.md,
"Weight sync".
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

PERIOD = 4093  # words; prime (see above), and small: each tensor costs a PERIOD-long reduction
_ROW_BYTES = 4 * PERIOD
_MASK = (1 << 64) - 1


def _column_sums(tensor: torch.Tensor) -> torch.Tensor:
    """[PERIOD] int32 on the tensor's device: column c sums words c, c + PERIOD, ... mod 2**32,
    the bytes after the last whole row zero-padded (so any byte count works)."""
    raw = tensor.detach().contiguous().view(-1).view(torch.uint8)
    if raw.storage_offset() % 4:  # a view starting mid-word cannot be read as int32 in place
        raw = raw.clone()
    whole = raw.numel() // _ROW_BYTES * _ROW_BYTES
    rows = raw[:whole].view(torch.int32).view(whole // _ROW_BYTES, PERIOD)
    tail = raw.new_zeros(_ROW_BYTES)
    tail[:raw.numel() - whole] = raw[whole:]
    return rows.sum(0, dtype=torch.int32) + tail.view(torch.int32)


def _plain_and_weighted(columns: torch.Tensor) -> torch.Tensor:
    """[n, PERIOD] int32 column sums -> [n, 2] int64 (plain, weighted), exact: |weighted| < 2**55."""
    columns = columns.to(torch.int64)
    weights = torch.arange(1, PERIOD + 1, dtype=torch.int64, device=columns.device)
    return torch.stack([columns.sum(1), (columns * weights).sum(1)], dim=1)


def tensor_checksum(tensor: torch.Tensor) -> tuple[int, int]:
    """(plain, weighted) sums of the tensor's column sums, as unsigned 64-bit ints."""
    running = RunningChecksum(tensor.device)
    running.add(tensor, 0)
    return running.sums()


class RunningChecksum:
    """`tensor_checksum` of a byte buffer that arrives in pieces, each summed as it comes, on the
    device: a piece starting `byte_offset` bytes in has its column sums rotated to the columns
    its words hold in the whole buffer, so the pieces of a buffer, in any order, sum to the
    whole buffer's columns."""

    def __init__(self, device: torch.device | str):
        self.columns = torch.zeros(PERIOD, dtype=torch.int32, device=device)

    def add(self, piece: torch.Tensor, byte_offset: int) -> None:
        """Adds the bytes of `piece`, found at `byte_offset` (a multiple of 4) of the buffer."""
        if byte_offset % 4:
            raise ValueError(f"byte_offset must be a multiple of 4, got {byte_offset}")
        self.columns += torch.roll(_column_sums(piece), (byte_offset // 4) % PERIOD)

    def sums_tensor(self) -> torch.Tensor:
        """[2] int64 (plain, weighted) on the device: no host sync."""
        return _plain_and_weighted(self.columns[None])[0]

    def sums(self) -> tuple[int, int]:
        return unsigned(*self.sums_tensor().tolist())


def unsigned(plain: int, weighted: int) -> tuple[int, int]:
    """(plain, weighted) sums read from int64 as the unsigned 64-bit ints the digests use."""
    return plain & _MASK, weighted & _MASK


def state_checksum(named_tensors: Iterable[tuple[str, torch.Tensor]] | dict[str, torch.Tensor]) -> str:
    """One hex digest over names, dtypes, shapes and contents, independent of iteration order.
    The tensors must share a device; their sums reach the host in one transfer."""
    items = named_tensors.items() if isinstance(named_tensors, dict) else named_tensors
    items = sorted(items, key=lambda kv: kv[0])
    sums = _plain_and_weighted(torch.stack([_column_sums(t) for _, t in items])).tolist() if items else []
    parts = [f"{name}:{tensor.dtype}:{tuple(tensor.shape)}:{plain & _MASK:016x}{weighted & _MASK:016x}"
             for (name, tensor), (plain, weighted) in zip(items, sums)]
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=16).hexdigest()


class ChecksumMismatch(RuntimeError):
    """The weights a replica loaded are not the ones the trainer sent."""
