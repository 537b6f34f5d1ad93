"""Batch-invariant attention: one function, ``attend`` (an ``AttentionPlan``), for the trainer
(``BatchInvariantAttention``) and the native engine (``BatchInvariantPagedAttention``) in true
on-policy mode.

Each side splits keys and batches queries its own way (SDPA over a whole document in training, one
query against a KV cache in decode), which rounds differently. ``attend`` computes a query's
output from its own row and its sequence's keys alone, in one fixed order. On CPU a C kernel does
so for each query (``rlactors.on_policy.cpu_kernels.attend``). On CUDA a Triton kernel
(``attention_triton``) reads keys in blocks of ``KEY_BLOCK`` from position 0 and folds them in
order by an online softmax, with a fixed tile shape; a block past a query's position is an exact
no-op.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from rlactors.attention.varlen import VarlenAttention, cu_seqlens_from_positions
from rlactors.on_policy import cpu_kernels, ops

QUERY_TILE = 16  # query positions per attention tile (CUDA)
KEY_BLOCK = 64  # keys per attention block, counted from position 0 of a sequence (CUDA)


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
    position. CPU: ``cpu_kernels.attend`` computes each query on its own, in a fixed order. CUDA:
    consecutive queries of a segment share a tile of rows, but rows of a tile never
    mix (a row of a matmul reads only its own row). Keys are read in blocks of ``KEY_BLOCK``
    starting at position 0 and folded in order by an online softmax; a block entirely past a
    query's position leaves its running max, sum and output exactly unchanged (its weights are
    exp(-inf) = 0 and its rescale factor exp(0) = 1), so it does not matter how many blocks a
    tile reads. The trainer (a whole document at once) and the engine (one decode query, or a
    prefill chunk, against its KV cache) thus compute bitwise the same values.

    Layout: tile ``t`` holds up to ``tile_size`` consecutive queries of one segment;
    ``tile[i], slot[i]`` is where query ``i`` sits and ``query_index[t, s]`` the query in a slot
    (-1: empty); ``positions[t, s]`` is the position in each slot (0 for an empty slot, whose
    output is dropped); ``last[t]`` the largest one; ``tile_size`` is ``QUERY_TILE`` (the kernel
    is compiled for it).

    Two ways to pass keys: ``plan(q, keys, values)`` with every segment's keys in a row, or
    ``plan.paged(q, kv, key_slots)`` with them in slots of a shared buffer (a paged KV cache, or
    the packed keys of a training batch), which the CPU kernel reads in place.
    """

    def __init__(self, q_positions: torch.Tensor, q_segments: torch.Tensor):
        if q_positions.dim() != 1 or q_segments.shape != q_positions.shape or q_positions.numel() == 0:
            raise ValueError(f"attend: q_positions {tuple(q_positions.shape)} and q_segments "
                             f"{tuple(q_segments.shape)} must be non-empty and 1-D of equal length")
        if int(q_positions.min()) < 0 or int(q_segments.min()) < 0:
            raise ValueError("attend: query positions and segments must be >= 0")
        n, device = q_segments.shape[0], q_segments.device
        self.num_queries = n
        self.q_positions, self.q_segments = q_positions, q_segments
        self.max_position, self.max_segment = int(q_positions.max()), int(q_segments.max())
        if device.type == "cuda":
            self._tile(q_positions, q_segments)

    def _tile(self, q_positions: torch.Tensor, q_segments: torch.Tensor) -> None:
        """The CUDA kernel's layout of the queries in tiles (the class docstring's)."""
        n, device = q_segments.shape[0], q_segments.device
        starts_run = torch.ones(n, dtype=torch.bool, device=device)
        starts_run[1:] = q_segments[1:] != q_segments[:-1]
        run = starts_run.cumsum(0) - 1
        run_starts = torch.nonzero(starts_run).flatten()
        index_in_run = torch.arange(n, device=device) - run_starts[run]
        run_lengths = torch.diff(run_starts, append=run_starts.new_tensor([n]))
        size = QUERY_TILE
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

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        if keys.dim() != 4 or values.shape != keys.shape:
            raise ValueError(f"attend: need keys/values [S, Hkv, L, D], got keys {tuple(keys.shape)}, "
                             f"values {tuple(values.shape)}")
        num_segments, num_kv_heads, length, head_dim = keys.shape
        self._check(q, num_kv_heads, head_dim, num_segments, length, f"keys {tuple(keys.shape)}")
        if q.is_cuda:
            return _triton().attend(self, q, keys, values)
        # Each segment's keys as one run of slots of a [2, Hkv, S * L, D] buffer.
        kv = torch.stack((keys, values)).transpose(1, 2).reshape(2, num_kv_heads, num_segments * length, head_dim)
        slots = torch.arange(num_segments * length, device=keys.device).view(num_segments, length)
        return self._attend_cpu(q, kv, slots)

    def paged(self, q: torch.Tensor, kv: torch.Tensor, key_slots: torch.Tensor) -> torch.Tensor:
        """``attend`` with keys in slots: ``kv [2, Hkv, R, D]`` holds K and V of ``R`` slots (the
        CPU kernel reads it in place when it is contiguous fp32), ``key_slots [S, L]`` the slot
        of segment ``s``'s key at position ``p`` (only entries up to each segment's last query
        position are read; the others must be valid slots all the same)."""
        if kv.dim() != 4 or kv.shape[0] != 2 or key_slots.dim() != 2:
            raise ValueError(f"attend: need kv [2, Hkv, R, D] and key_slots [S, L], got kv {tuple(kv.shape)}, "
                             f"key_slots {tuple(key_slots.shape)}")
        self._check(q, kv.shape[1], kv.shape[3], *key_slots.shape, f"key_slots {tuple(key_slots.shape)}")
        if q.is_cuda:
            gathered = kv[:, :, key_slots].transpose(1, 2)  # [2, S, Hkv, L, D]
            return _triton().attend(self, q, gathered[0], gathered[1])
        return self._attend_cpu(q, kv, key_slots)

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

    def _attend_cpu(self, q: torch.Tensor, kv: torch.Tensor, key_slots: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = cpu_kernels.attend(q, kv, key_slots, self.q_segments, self.q_positions)
        return out.to(q.dtype)


class BatchInvariantAttention:
    """The trainer's ``attention(layer_idx, q, k, v)`` in true on-policy mode.

    Same contract as ``VarlenAttention`` (packed documents, causal inside each, never across):
    every document is a segment of ``attend``, its queries at positions ``0 .. len-1``, its keys
    read from the packed ones in place. The backward pass differentiates the default
    ``VarlenAttention`` at the same inputs.
    """

    def __init__(self, cu_seqlens: torch.Tensor, max_seqlen: int, backend: str = "auto"):
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
        cu_seqlens = cu_seqlens_from_positions(positions)
        return cls(cu_seqlens, int(cu_seqlens.diff().max().item()), backend)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.shape[0] != self.positions.numel() or k.shape[0] != q.shape[0] or v.shape != k.shape:
            raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match the "
                             f"{self.positions.numel()} packed tokens of this BatchInvariantAttention")
        return OnPolicyAttentionFunction.apply(q, k, v, self)

    def forward_values(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dtype = k.dtype if k.is_cuda else torch.float32  # what each kernel reads
        kv = torch.stack((k.transpose(0, 1), v.transpose(0, 1))).to(dtype)  # [2, Hkv, T, D], contiguous
        return self.plan.paged(q, kv, self.key_slots)


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

        return ops.default_gradients(default, ctx.saved_tensors, ctx.needs_input_grad, grad) + (None,)


class BatchInvariantPagedAttention:
    """The native engine's ``attention(layer_idx, q, k, v)`` in true on-policy mode, over its paged
    KV cache (``rlactors.engines.kv_cache.PagedKVCache``) for one packed step of ``chunks``
    (``kv_cache.Chunk``s, in packed order).

    Writes the step's k/v into the cache like the engine's default ``PagedAttention``, then every
    query attends to its sequence's context, read in place from the cache's slots, through
    ``AttentionPlan``, as the trainer's ``BatchInvariantAttention`` does, so a query's output does
    not depend on the other sequences of the step or on chunking.
    """

    def __init__(self, cache, chunks: Sequence):
        self.cache = cache
        device = cache.kv.device
        bs = cache.block_size
        width = max(-(-(c.start + c.num_tokens) // bs) for c in chunks)  # blocks of the longest context
        # [sequences, width * bs]: the slot of each position; padding blocks hold other data,
        # which no query reads.
        blocks = torch.tensor([list(c.block_ids[:width]) + [0] * (width - min(width, len(c.block_ids)))
                               for c in chunks])
        self.key_slots = (blocks[:, :, None] * bs + torch.arange(bs)).flatten(1).to(device)
        positions = [p for c in chunks for p in range(c.start, c.start + c.num_tokens)]
        segments = [i for i, c in enumerate(chunks) for _ in range(c.num_tokens)]
        slots = [c.block_ids[p // bs] * bs + p % bs for c in chunks for p in range(c.start, c.start + c.num_tokens)]
        self.plan = AttentionPlan(torch.tensor(positions, device=device), torch.tensor(segments, device=device))
        self.slot_mapping = torch.tensor(slots, device=device)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.cache.write(layer_idx, self.slot_mapping, k, v)
        return self.plan.paged(q, self.cache.kv[layer_idx], self.key_slots)


@functools.cache
def _triton():
    """The Triton attention kernel (imported on first CUDA use: Triton is not needed on CPU)."""
    from rlactors.on_policy import attention_triton

    return attention_triton
