"""Batch-invariant attention: one function, ``attend`` (an ``AttentionPlan``), for the trainer and
the native engine in true on-policy mode.

Each side splits keys and batches queries its own way (SDPA over a whole document in training, one
query against a KV cache in decode), which rounds differently. ``attend`` reads keys in blocks of
``KEY_BLOCK`` from position 0 and folds them in order by an online softmax; a block past a query's
position is an exact no-op, so a query's output depends only on its own row and its sequence's
keys. On CPU its two products are exact (``rlactors.models.batch_invariant.exact_matmul``), with
every key and value row rounded once, before the keys are stored or read (``prepare_keys_values``);
on CUDA a Triton kernel (``invariant_triton``) fixes the tile shape and the order.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from rlactors.models import batch_invariant as bi

QUERY_TILE = 16  # query positions per attention tile (CUDA)
# CPU: tiles of up to 32 queries; a tile size changes no bit there (measured: packed documents of
# 200-512 tokens ran 1.4x faster than with 16, documents of 48-96 tokens as fast).
CPU_QUERY_TILE = 32
KEY_BLOCK = 64  # keys per attention block, counted from position 0 of a sequence
VALUE_BITS = bi.weighted_sum_bits(KEY_BLOCK)  # the CPU path's rounding of value rows (and of its weights)


def prepare_keys_values(k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Keys and values ``[..., D]`` as ``AttentionPlan.paged`` reads them, in ``dtype`` (default:
    their own), and the values' row powers (fp64 ``[...]``; None on CUDA).

    CPU: every row (one token's keys or values of one head) rounded by ``rounded_rows`` for the
    exact products, keys to ``fixed_point_bits(D)`` bits and values to ``VALUE_BITS``: each row
    on its own, so the trainer (a batch of documents) and the engine (rows as they enter its KV
    cache) hold the same values, and every row is rounded once however often it is read. A cast
    to the input's dtype or a wider one is exact (``rounded_rows``). The row powers
    (``batch_invariant.row_powers`` of the rounded values) spare every read the pass that finds
    them. CUDA: unchanged (the kernel reads raw keys).
    """
    if k.is_cuda:
        return k, v, None
    values = bi.rounded_rows(v, VALUE_BITS)
    return (bi.rounded_rows(k, bi.fixed_point_bits(k.shape[-1])).to(dtype or k.dtype),
            values.to(dtype or v.dtype), bi.row_powers(values))


def attend(q: torch.Tensor, q_positions: torch.Tensor, q_segments: torch.Tensor,
           keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Causal attention of queries against their sequence's keys, the same way for every caller.

    - ``q [N, Hq, D]``: queries; query ``i`` belongs to segment ``q_segments[i]`` and sits at
      position ``q_positions[i]`` there, so it attends to that segment's keys ``0 .. position``.
    - ``keys, values [S, Hkv, L, D]`` (head-major, as a paged cache gathers them): segment
      ``s``'s keys at positions ``0 .. L-1``
      (``Hq % Hkv == 0``, GQA). Entries past every query's position are never read into the
      result (they may hold anything, NaN included).

    Returns ``[N, Hq, D]`` in ``q``'s dtype, scale ``1/sqrt(D)``, computed in fp32. Callers that
    attend once per layer build the ``AttentionPlan`` once and call it per layer instead.
    """
    return AttentionPlan(q_positions, q_segments)(q, keys, values)


class AttentionPlan:
    """``attend`` for one fixed set of queries (positions and segments), reused by every layer.

    Invariance: a query's output depends only on its own row and its segment's keys up to its
    position. Consecutive queries of a segment share a tile of rows, but rows of a tile never
    mix (a row of a matmul reads only its own row). Keys are read in blocks of ``KEY_BLOCK``
    starting at position 0 and folded in order by an online softmax; a block entirely past a
    query's position leaves its running max, sum and output exactly unchanged (its weights are
    exp(-inf) = 0 and its rescale factor exp(0) = 1), so it does not matter how many blocks a
    tile reads. The trainer (a whole document at once) and the engine (one decode query, or a
    prefill chunk, against its KV cache) thus compute bitwise the same values.

    Layout: tile ``t`` holds up to ``tile_size`` consecutive queries of one segment;
    ``tile[i], slot[i]`` is where query ``i`` sits and ``query_index[t, s]`` the query in a slot
    (-1: empty); ``positions[t, s]`` is the position in each slot (0 for an empty slot, whose
    output is dropped); ``last[t]`` the largest one. On CUDA ``tile_size`` is ``QUERY_TILE``
    (the kernel is compiled for it); on CPU, where ``exact_matmul`` gives a row the same bits for any
    number of rows, it is ``CPU_QUERY_TILE`` or, if shorter, the longest run of queries, so
    decode steps pad nothing.

    Two ways to pass keys: ``plan(q, keys, values)`` with every segment's keys in a row, or
    ``plan.paged(q, kv, key_slots)`` with them in slots of a shared buffer (a paged KV cache, or
    the packed keys of a training batch), which the CPU path reads without copying it whole.
    """

    def __init__(self, q_positions: torch.Tensor, q_segments: torch.Tensor):
        if q_positions.dim() != 1 or q_segments.shape != q_positions.shape or q_positions.numel() == 0:
            raise ValueError(f"attend: q_positions {tuple(q_positions.shape)} and q_segments "
                             f"{tuple(q_segments.shape)} must be non-empty and 1-D of equal length")
        if int(q_positions.min()) < 0 or int(q_segments.min()) < 0:
            raise ValueError("attend: query positions and segments must be >= 0")
        n, device = q_segments.shape[0], q_segments.device
        self.num_queries = n
        self.max_position, self.max_segment = int(q_positions.max()), int(q_segments.max())
        starts_run = torch.ones(n, dtype=torch.bool, device=device)
        starts_run[1:] = q_segments[1:] != q_segments[:-1]
        run = starts_run.cumsum(0) - 1
        run_starts = torch.nonzero(starts_run).flatten()
        index_in_run = torch.arange(n, device=device) - run_starts[run]
        run_lengths = torch.diff(run_starts, append=run_starts.new_tensor([n]))
        size = QUERY_TILE if device.type == "cuda" else min(CPU_QUERY_TILE, int(run_lengths.max()))
        run_tiles = -(-run_lengths // size)
        first_tile = run_tiles.cumsum(0) - run_tiles
        self.tile_size = size
        self.tile = first_tile[run] + index_in_run // size
        self.slot = index_in_run % size
        self.num_tiles = int(run_tiles.sum())
        self.segment = torch.zeros(self.num_tiles, dtype=torch.long, device=device)
        self.segment[self.tile] = q_segments.long()
        self.positions = torch.zeros(self.num_tiles, size, dtype=torch.long, device=device)
        self.positions[self.tile, self.slot] = q_positions.long()
        self.last = self.positions.amax(1)
        self.query_index = torch.full((self.num_tiles, size), -1, dtype=torch.long, device=device)
        self.query_index[self.tile, self.slot] = torch.arange(n, device=device)
        self.num_blocks = self.max_position // KEY_BLOCK + 1
        self._reads: _TorchReads | None = None

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        if keys.dim() != 4 or values.shape != keys.shape:
            raise ValueError(f"attend: need keys/values [S, Hkv, L, D], got keys {tuple(keys.shape)}, "
                             f"values {tuple(values.shape)}")
        num_segments, num_kv_heads, length, head_dim = keys.shape
        self._check(q, num_kv_heads, head_dim, num_segments, length, f"keys {tuple(keys.shape)}")
        if q.is_cuda:
            return _triton().attend(self, q, keys, values)
        # Each segment's keys as one run of slots of a [2, Hkv, S * L, D] buffer.
        keys, values, powers = prepare_keys_values(keys, values, torch.float64)
        kv = torch.stack((keys, values)).transpose(1, 2).reshape(2, num_kv_heads, num_segments * length, head_dim)
        powers = powers.transpose(0, 1).reshape(num_kv_heads, num_segments * length)
        slots = torch.arange(num_segments * length, device=keys.device).view(num_segments, length)
        with torch.no_grad():
            return self._attend_torch(q, kv, slots, powers)

    def paged(self, q: torch.Tensor, kv: torch.Tensor, key_slots: torch.Tensor,
              value_powers: torch.Tensor | None = None) -> torch.Tensor:
        """``attend`` with keys in slots: ``kv [2, Hkv, R, D]`` holds K and V of ``R`` slots as
        ``prepare_keys_values`` returns them (the CPU path reads it most cheaply when
        contiguous), ``key_slots [S, L]`` the slot of segment ``s``'s key at position ``p`` (only
        entries up to each segment's last query position are read; the others must be valid
        slots all the same). ``value_powers [Hkv, R]``: the value rows' powers that
        ``prepare_keys_values`` returned (CPU; without them each read finds them again)."""
        if kv.dim() != 4 or kv.shape[0] != 2 or key_slots.dim() != 2:
            raise ValueError(f"attend: need kv [2, Hkv, R, D] and key_slots [S, L], got kv {tuple(kv.shape)}, "
                             f"key_slots {tuple(key_slots.shape)}")
        self._check(q, kv.shape[1], kv.shape[3], *key_slots.shape, f"key_slots {tuple(key_slots.shape)}")
        if q.is_cuda:
            gathered = kv[:, :, key_slots].transpose(1, 2)  # [2, S, Hkv, L, D]
            return _triton().attend(self, q, gathered[0], gathered[1])
        with torch.no_grad():
            return self._attend_torch(q, kv, key_slots, value_powers)

    def _check(self, q: torch.Tensor, num_kv_heads: int, head_dim: int, num_segments: int, length: int,
               keys: str) -> None:
        if q.dim() != 3 or q.shape[0] != self.num_queries:
            raise ValueError(f"attend: need q [{self.num_queries}, Hq, D], got q {tuple(q.shape)}")
        if q.shape[2] != head_dim or q.shape[1] % num_kv_heads:
            raise ValueError(f"attend: q {tuple(q.shape)} and {keys} disagree on head_dim, "
                             "or the query heads are not a multiple of the kv heads")
        if self.max_position >= length or self.max_segment >= num_segments:
            raise ValueError(f"attend: {keys} do not reach query position {self.max_position} "
                             f"of segment {self.max_segment}")

    def _attend_torch(self, q: torch.Tensor, kv: torch.Tensor, key_slots: torch.Tensor,
                      value_powers: torch.Tensor | None) -> torch.Tensor:
        n, num_heads, head_dim = q.shape
        num_kv_heads = kv.shape[1]
        group = num_heads // num_kv_heads
        reads = self._torch_reads(key_slots, num_kv_heads, group, kv.shape[2])
        nt = self.num_tiles
        # exact_matmul's products: the queries rounded here, the keys when they were prepared.
        q_all = bi.rounded_rows(q.float() / math.sqrt(head_dim), bi.fixed_point_bits(head_dim))
        q_all = q_all.view(n * num_kv_heads, group, head_dim)
        kv_all = kv.reshape(-1, head_dim)
        # The online softmax over each tile's blocks, in order, a chunk of blocks at a time. The
        # running max, sum and output of every tile carry from chunk to chunk; the tiles that read
        # block b are the last ones of the tile order, so they are a tail slice of the state.
        tile_max = tile_sum = tile_out = None
        for chunk in reads.chunks():
            rows = chunk.num_rows
            q_rows = q_all.index_select(0, chunk.q_index).view(rows, num_kv_heads, -1, head_dim)
            # K and V of the chunk's rows in fp64 for the exact products: a fresh copy, which the
            # weighted sum may overwrite (as it may the fp64 products, once they are scores).
            kv_rows = kv_all.index_select(0, chunk.kv_index).double()
            keys, values = kv_rows.view(2, rows, num_kv_heads, KEY_BLOCK, head_dim)
            products = torch.matmul(q_rows, keys.mT)  # [rows, Hkv, slot * group, KB]
            scores = products.float().add_(chunk.hidden)
            # The running max first (exact, so it can be folded before the rest), then weights
            # and sums of the chunk's blocks at once, then each block's sum and output folded in.
            running_max = scores.amax(-1)
            before = []  # per block: its tiles' running max through the previous block
            for start, count in chunk.blocks:
                block_max = running_max[start:start + count]
                if tile_max is None:  # block 0, which every tile reads
                    tile_max = block_max.clone()
                    before.append(None)
                    continue
                before.append(tile_max[nt - count:].clone())
                torch.maximum(before[-1], block_max, out=block_max)
                tile_max[nt - count:] = block_max
            # exp takes a slow path (~10x here) for -inf and for results below fp32's normal range:
            # exponents are clamped at -80 (a weight below exp(-80) ~ 2e-35, next to the row's
            # largest, 1, becomes exp(-80)) and the hidden keys' weights zeroed by a multiply.
            weights = scores.sub_(running_max[..., None]).clamp_(min=-80.0).exp_().mul_(chunk.visible)
            sums = weights.sum(-1)
            powers = None
            if value_powers is not None:
                powers = value_powers.reshape(-1).index_select(0, chunk.power_index).view(values.shape[:-1])
            outs = bi.weighted_sum_of_rounded(weights, values, VALUE_BITS, value_powers=powers,
                                              nonnegative_weights=True, overwrite_values=True, scaled_out=products)
            for (start, count), previous in zip(chunk.blocks, before):
                if previous is None:
                    tile_sum, tile_out = sums[start:start + count].clone(), outs[start:start + count].clone()
                    continue
                rescale = torch.exp(previous - running_max[start:start + count])
                tile_sum[nt - count:].mul_(rescale).add_(sums[start:start + count])
                tile_out[nt - count:].mul_(rescale[..., None]).add_(outs[start:start + count])

        out = (tile_out / tile_sum[..., None]).view(nt * num_kv_heads * self.tile_size, group, head_dim)
        if reads.out_index is not None:
            out = out.index_select(0, reads.out_index)
        return out.view(n, num_heads, head_dim).to(q.dtype)

    def _torch_reads(self, key_slots: torch.Tensor, num_kv_heads: int, group: int, num_slots: int) -> _TorchReads:
        """The gather indices and masks of the CPU path; every layer of a step reads the same."""
        reads = self._reads
        if reads is None or not reads.serves(key_slots, num_kv_heads, group, num_slots):
            reads = self._reads = _TorchReads(self, key_slots, num_kv_heads, group, num_slots)
        return reads


CHUNK_ROWS = 256  # (tile, key block) rows per pass of the CPU path: its memory per layer is linear in length


class _TorchReads:
    """What the CPU path of an ``AttentionPlan`` reads, for one key-slot table and head layout.

    Rows: one per (key block, tile that reads it), block-major. Tiles are taken in order of
    their last query position, so the tiles that read block ``b`` (those whose last position is
    at least ``b * KEY_BLOCK``, which read every earlier block too) are the last ones of that
    order. A key past its tile's last query (stale cache slots, padding, other segments) is read
    from the segment's position 0 instead: finite, and its weight is exactly 0 anyway, so its
    product adds an exact zero (a NaN read there would poison the sum).

    Kept for the whole step, one entry per row: ``queries [row, slot]`` (the query in each slot),
    ``slots [row, KEY_BLOCK]`` (the key slot read) and ``hidden [row, slot, KEY_BLOCK]`` (the
    keys the slot's query must not see). The per-head gather indices and masks are made one
    chunk of blocks (about ``CHUNK_ROWS`` rows) at a time, so a long document costs memory in
    proportion to its length, not its square; a step of one chunk keeps its chunk for every layer.
    ``out_index``: the rows of ``[tile, kv head, slot]`` for each query's kv heads (None: in order
    already, as in a decode step of sequences sorted by length).
    """

    def __init__(self, plan: AttentionPlan, key_slots: torch.Tensor, num_kv_heads: int, group: int,
                 num_slots: int):
        self.key_slots, self.shape = key_slots, (num_kv_heads, group, num_slots)
        device, nt, size = key_slots.device, plan.num_tiles, plan.tile_size
        order = torch.sort(plan.last, stable=True).indices
        last = plan.last[order]
        block_starts = torch.arange(plan.num_blocks, device=device) * KEY_BLOCK
        block, row_tile = torch.nonzero(last[None, :] >= block_starts[:, None]).unbind(1)
        tile = order[row_tile]
        self.queries = plan.query_index[tile].clamp(min=0)  # an empty slot reads any query; dropped
        key_positions = block_starts[block, None] + torch.arange(KEY_BLOCK, device=device)  # [rows, KB]
        read = torch.where(key_positions <= plan.last[tile, None], key_positions, 0)
        self.slots = key_slots[plan.segment[tile, None], read]
        self.hidden = key_positions[:, None, :] > plan.positions[tile, :, None]  # [rows, slot, KB]

        counts = torch.bincount(block, minlength=plan.num_blocks).tolist()
        firsts = [0]
        for count in counts[:-1]:
            firsts.append(firsts[-1] + count)
        self.blocks = list(zip(firsts, counts))  # (first row, rows) per block
        self.spans, first = [], 0  # (first block, end block) per chunk
        for b in range(1, len(counts) + 1):
            if b == len(counts) or self.blocks[b][0] + counts[b] - self.blocks[first][0] > CHUNK_ROWS:
                self.spans.append((first, b))
                first = b
        self._only_chunk = self._chunk(*self.spans[0]) if len(self.spans) == 1 else None

        # Rows [tile, kv head, slot] are queries [query, kv head] when every tile is one query,
        # in order already (a decode step).
        heads = torch.arange(num_kv_heads, device=device)
        self.out_index = None
        if size != 1 or not torch.equal(order, torch.arange(nt, device=device)):
            rank = torch.empty_like(order)
            rank[order] = torch.arange(nt, device=device)
            out_index = ((rank[plan.tile] * num_kv_heads)[:, None] + heads[None, :]) * size + plan.slot[:, None]
            self.out_index = out_index.flatten()

    def serves(self, key_slots: torch.Tensor, num_kv_heads: int, group: int, num_slots: int) -> bool:
        return self.key_slots is key_slots and self.shape == (num_kv_heads, group, num_slots)

    def chunks(self):
        if self._only_chunk is not None:
            yield self._only_chunk
        else:
            for span in self.spans:
                yield self._chunk(*span)

    def _chunk(self, first_block: int, end_block: int) -> _Chunk:
        num_kv_heads, group, num_slots = self.shape
        lo = self.blocks[first_block][0]
        hi = lo + sum(count for _, count in self.blocks[first_block:end_block])
        device = self.slots.device
        heads = torch.arange(num_kv_heads, device=device)
        q_index = (self.queries[lo:hi, None, :] * num_kv_heads + heads[None, :, None]).flatten()
        kv_heads = torch.arange(2 * num_kv_heads, device=device).view(2, 1, num_kv_heads, 1)
        kv_index = (kv_heads * num_slots + self.slots[None, lo:hi, None, :]).flatten()
        hidden = self.hidden[lo:hi, None, :, None, :].expand(-1, num_kv_heads, -1, group, -1)
        hidden = hidden.reshape(hi - lo, num_kv_heads, -1, KEY_BLOCK)
        blocks = [(start - lo, count) for start, count in self.blocks[first_block:end_block]]
        power_index = kv_index.view(2, -1)[1] - num_kv_heads * num_slots  # V's rows in [Hkv * R]
        return _Chunk(hi - lo, blocks, q_index, kv_index, power_index,
                      torch.zeros(hidden.shape, device=device).masked_fill_(hidden, float("-inf")),
                      (~hidden).float())


@dataclass
class _Chunk:
    """Rows of consecutive key blocks of a ``_TorchReads``, ready to gather and mask: ``blocks``
    (first row in the chunk, rows) per block; ``q_index`` the rows of ``q [N * Hkv, group, D]``
    for ``[row, kv head, slot]``; ``kv_index`` the rows of ``kv [2 * Hkv * R, D]`` for ``[2, row,
    kv head, KEY_BLOCK]`` and ``power_index`` those of the value powers ``[Hkv * R]`` for its
    values; ``hidden`` -inf for the keys each query must not see, else 0, ``[row, Hkv,
    slot * group, KEY_BLOCK]``, and ``visible`` 0 there, else 1."""

    num_rows: int
    blocks: list[tuple[int, int]]
    q_index: torch.Tensor
    kv_index: torch.Tensor
    power_index: torch.Tensor
    hidden: torch.Tensor
    visible: torch.Tensor


class BatchInvariantAttention:
    """The trainer's ``attention(layer_idx, q, k, v)`` in true on-policy mode.

    Same contract as ``VarlenAttention`` (packed documents, causal inside each, never across):
    every document is a segment of ``attend``, its queries at positions ``0 .. len-1``, its keys
    read from the packed ones in place. The backward pass differentiates the default
    ``VarlenAttention`` at the same inputs.
    """

    def __init__(self, cu_seqlens: torch.Tensor, max_seqlen: int, backend: str = "auto"):
        from rlactors.attention.varlen import VarlenAttention

        self.reference = VarlenAttention(cu_seqlens, max_seqlen, backend)
        device = cu_seqlens.device
        lengths = cu_seqlens.diff().long()
        self.segments = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)
        starts = cu_seqlens[:-1].long()
        self.positions = torch.arange(int(cu_seqlens[-1]), device=device) - starts[self.segments]
        # Document d's key at position p is packed token starts[d] + p (clamped: a valid slot
        # for the positions past the document's end, which are never read into a result).
        self.key_slots = (starts[:, None] + torch.arange(max_seqlen, device=device)).clamp(
            max=self.positions.numel() - 1)
        self.plan = AttentionPlan(self.positions, self.segments)

    @classmethod
    def from_positions(cls, positions: torch.Tensor, backend: str = "auto") -> BatchInvariantAttention:
        from rlactors.attention.varlen import cu_seqlens_from_positions

        cu_seqlens = cu_seqlens_from_positions(positions)
        return cls(cu_seqlens, int(cu_seqlens.diff().max().item()), backend)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.shape[0] != self.positions.numel() or k.shape[0] != q.shape[0] or v.shape != k.shape:
            raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match the "
                             f"{self.positions.numel()} packed tokens of this BatchInvariantAttention")
        return OnPolicyAttentionFunction.apply(q, k, v, self)

    def forward_values(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k, v, powers = prepare_keys_values(k, v, torch.float64)  # fp64: what the exact products read
        kv = torch.stack((k.transpose(0, 1), v.transpose(0, 1)))  # [2, Hkv, T, D], contiguous
        return self.plan.paged(q, kv, self.key_slots, None if powers is None else powers.t().contiguous())


class OnPolicyAttentionFunction(torch.autograd.Function):
    """Autograd for a trainer's true on-policy attention: the forward values of
    ``attention.forward_values`` (the generator's kernel), the gradient of ``attention.reference``
    (the default attention) at the same inputs."""

    @staticmethod
    def forward(ctx, q, k, v, attention: BatchInvariantAttention):
        ctx.save_for_backward(q, k, v)
        ctx.attention = attention
        return attention.forward_values(q, k, v)

    @staticmethod
    def backward(ctx, grad):
        def default(q, k, v):
            return ctx.attention.reference(0, q, k, v)

        return bi.default_gradients(default, ctx.saved_tensors, ctx.needs_input_grad, grad) + (None,)


@functools.cache
def _triton():
    """The Triton attention kernel (imported on first CUDA use: Triton is not needed on CPU)."""
    from rlactors.attention import invariant_triton

    return invariant_triton
