"""Paged KV cache for the native engine: a block pool with prefix caching, and the cache's tensor
(``paged_attention`` reads and writes it, and in true on-policy mode
``rlactors.on_policy.attention.BatchInvariantPagedAttention``).

The cache is a fixed number of blocks of `block_size` token slots per layer. A sequence owns a
list of blocks (its block table); token `p` of the sequence lives in slot
`block_ids[p // block_size] * block_size + p % block_size`.

Prefix caching: every full block is named by a key chained over all tokens before it, so two
sequences with the same first `n * block_size` tokens share those `n` blocks. Blocks nobody uses
stay cached until the pool needs them again (least recently freed first). Keys start from the
pool's epoch, so `reset_prefix_cache()` (after a weight change) makes all earlier KV unreachable.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def chain_key(parent_key: int, block_tokens: Sequence[int]) -> int:
    """Key of a full block: its tokens and (through `parent_key`) every token before it.

    A 64-bit hash: two different prefixes share a key with odds of about 1e-19 per pair.
    """
    return hash((parent_key, tuple(block_tokens)))


class BlockPool:
    """Block ids with reference counts, a free list in eviction order, and the prefix cache."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # oldest first
        self.block_keys: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # key -> block id
        self.epoch = 0

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now, cached-but-unused ones included."""
        return len(self.free)

    def root_key(self) -> int:
        return hash(("rlactors-kv-root", self.epoch))

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} KV blocks with {len(self.free)} free")
        blocks = []
        for _ in range(n):
            block, _ = self.free.popitem(last=False)
            self._uncache(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def release(self, blocks: Sequence[int]) -> None:
        # The tail of a sequence is the least likely to be shared: free it first, evict it first.
        for block in reversed(blocks):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None

    def lookup(self, keys: Sequence[int]) -> list[int]:
        """Cached blocks for the longest prefix of `keys` (no reference taken)."""
        hits = []
        for key in keys:
            block = self.cached.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def acquire(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self.free[block]
            self.ref_counts[block] += 1

    def cache(self, block: int, key: int) -> None:
        """Publishes a full block under `key` (the first block with a given key wins)."""
        if key not in self.cached and self.block_keys[block] is None:
            self.cached[key] = block
            self.block_keys[block] = key

    def reset_prefix_cache(self) -> None:
        self.epoch += 1
        self.cached.clear()
        self.block_keys = [None] * self.num_blocks

    def _uncache(self, block: int) -> None:
        key = self.block_keys[block]
        if key is not None:
            del self.cached[key]
            self.block_keys[block] = None


@dataclass
class Chunk:
    """Tokens `start .. start + num_tokens - 1` of one sequence, computed in this step."""

    block_ids: Sequence[int]
    start: int
    num_tokens: int


class PagedKVCache:
    """K and V of every layer, `[num_layers, 2, num_kv_heads, num_blocks * block_size, head_dim]`.

    Head-major, so that a gather of whole blocks lands directly in the `[n, Hkv, C, D]` layout
    that SDPA reads, K and V in one call.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str):
        self.kv = torch.zeros((num_layers, 2, num_kv_heads, num_blocks * block_size, head_dim),
                              dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size

    def write(self, layer_idx: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores `k, v [T, Hkv, D]` at `slots [T]` (in the cache's dtype)."""
        self.kv[layer_idx].index_copy_(2, slots, torch.stack((k, v)).transpose(1, 2).to(self.kv.dtype))

    def gather(self, layer_idx: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole blocks: `blocks [n, B]` -> `[n, Hkv, B * block_size, D]` each."""
        _, heads, _, dim = self.kv.shape[1:]
        kv = self.kv[layer_idx].view(2, heads, self.num_blocks, self.block_size, dim)
        rows = kv.index_select(2, blocks.flatten()).view(2, heads, *blocks.shape, self.block_size, dim)
        rows = rows.flatten(3, 4).transpose(1, 2)  # [2, n, Hkv, C, D]
        return rows[0], rows[1]
