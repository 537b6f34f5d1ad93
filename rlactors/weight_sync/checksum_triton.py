"""The Triton kernel behind `RunningChecksum.add` on CUDA: a piece's column sums added straight
into the running columns, in one launch.

Each program sums its steps of the piece (STEP_ROWS whole rows of PERIOD words each) into an
accumulator of its own, indexed by a word's place in a step, in wrapping int32; at the end it adds
each of its entries to the column that place falls in, rotated by the piece's offset, with an
atomic add. Integer addition mod 2**32 does not depend on order, so the columns are bitwise those
of the torch path (`checksum._column_sums`, rotated), whatever the grid or the atomics' order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlactors.weight_sync.checksum import PERIOD

# A chunk is summed while the broadcast's NCCL kernel moves the next one, so it should read at
# about NVLink's pace on a few SMs, not burst on every SM at full HBM bandwidth beside the broadcast.
PROGRAMS = 32
STEP_ROWS = 4  # 4 rows are 16 * PERIOD bytes: every step starts 16-byte aligned, so loads are 128-bit
STEP_WORDS = STEP_ROWS * PERIOD
BLOCK = triton.next_power_of_2(STEP_WORDS)
NUM_WARPS = 16  # a BLOCK of int32 accumulators, and a BLOCK of loaded words, 32 registers a thread each


@triton.jit
def _add_column_sums(columns_ptr, piece_ptr, words, shift, PERIOD: tl.constexpr, STEP: tl.constexpr,
                     BLOCK: tl.constexpr):
    """columns[(i + shift) % PERIOD] += word i of the piece (`words` int32 words), wrapping. Offsets
    stay below `words`, so they fit its type (int32 below 2**31, else int64)."""
    piece_ptr = piece_ptr.to(tl.pointer_type(tl.int32))
    place = tl.arange(0, BLOCK)
    in_step = place < STEP
    program, programs = tl.program_id(0), tl.num_programs(0)
    sums = tl.zeros([BLOCK], dtype=tl.int32)
    whole_steps = words // STEP
    for step in range(program, whole_steps, programs):
        sums += tl.load(piece_ptr + step * STEP + place, mask=in_step, other=0)
    if program == whole_steps % programs:  # the program next in turn takes the last, partial step
        start = whole_steps * STEP
        sums += tl.load(piece_ptr + start + place, mask=place < words - start, other=0)
    tl.atomic_add(columns_ptr + (place + shift) % PERIOD, sums, mask=in_step, sem="relaxed")


def add_column_sums(columns: torch.Tensor, piece: torch.Tensor, shift: int) -> None:
    """Adds the column sums of `piece` (contiguous uint8 on CUDA, a whole number of 32-bit words
    at a 4-byte aligned address), rotated by `shift` columns, to `columns` ([PERIOD] int32)."""
    words = piece.numel() // 4
    if words == 0:
        return
    grid = (min(PROGRAMS, triton.cdiv(words, STEP_WORDS)),)
    with torch.cuda.device(piece.device):  # Triton launches on the current device's current stream
        _add_column_sums[grid](columns, piece, words, shift, PERIOD=PERIOD, STEP=STEP_WORDS, BLOCK=BLOCK,
                               num_warps=NUM_WARPS)
