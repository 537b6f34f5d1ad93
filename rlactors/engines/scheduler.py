"""The native engine's scheduler: which tokens of which sequences one step computes.

A sequence is its token ids (prompt, then generated) and how many of them already have KV in the
cache (`num_computed`). Each step gives every running sequence its pending tokens (one for a
decode, a chunk for a prefill) within a token budget (`max_num_tokens`), then admits waiting
sequences first-come-first-served while the budget, `max_num_seqs` and free KV blocks allow.
Requests never fail for lack of memory: they wait, and when a running sequence needs a block and
none is free, the most recently admitted sequence is preempted (its blocks freed, its tokens
recomputed when it is admitted again; full blocks usually come back from the prefix cache).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from rlactors.engines.kv_cache import BlockPool, Chunk, blocks_for, chain_key
from rlactors.types import SamplingParams


@dataclass(eq=False)
class SeqState:
    """One request inside the native engine: its tokens, KV blocks and sampling state."""

    request_id: str
    token_ids: list[int]  # prompt, then generated tokens
    prompt_len: int
    sampling: SamplingParams
    generator: torch.Generator
    arrival: float = field(default_factory=time.perf_counter)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routed_experts: list[list[list[int]]] = field(default_factory=list)  # per generated token (MoE)
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache
    cache_epoch: int = -1  # prefix-cache epoch at admission; -1 while waiting
    block_keys: list[int] = field(default_factory=list)  # keys of the full blocks computed so far
    first_scheduled: float | None = None
    first_token: float | None = None

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_pending(self) -> int:
        return len(self.token_ids) - self.num_computed


@dataclass
class ScheduledChunk:
    seq: SeqState
    start: int
    num_tokens: int

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the sequence's last token, whose logits give the next one."""
        return self.start + self.num_tokens == len(self.seq.token_ids)

    def as_chunk(self) -> Chunk:
        return Chunk(self.seq.block_ids, self.start, self.num_tokens)


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_tokens: int):
        if max_num_seqs < 1 or max_num_tokens < 1:
            raise ValueError(f"need max_num_seqs >= 1 and max_num_tokens >= 1, got {max_num_seqs}, {max_num_tokens}")
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_tokens = max_num_tokens
        self.waiting: deque[SeqState] = deque()
        self.running: list[SeqState] = []  # in admission order
        self.num_preemptions = 0
        self.num_prefix_hit_tokens = 0
        self.num_admitted_prompt_tokens = 0

    def add(self, seq: SeqState) -> None:
        self.waiting.append(seq)

    def remove(self, seq: SeqState) -> None:
        """Drops a finished or aborted sequence and frees its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.pool.release(seq.block_ids)
        seq.block_ids = []

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_tokens
        scheduled: list[ScheduledChunk] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_pending, budget)
            need = blocks_for(seq.num_computed + n, self.pool.block_size) - len(seq.block_ids)
            while need > self.pool.num_free and self.running[-1] is not seq:
                self._preempt(self.running.pop())
                preempted = True
            if need > self.pool.num_free:
                self._preempt(self.running.pop())  # seq itself: it waits until blocks free up
                preempted = True
                break
            seq.block_ids += self.pool.allocate(need)
            scheduled.append(ScheduledChunk(seq, seq.num_computed, n))
            budget -= n
            i += 1
        # Admitting while preempting would only swap one sequence for another.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            chunk = self._admit(self.waiting[0], budget)
            if chunk is None:
                break  # first come, first served: later requests do not overtake the head
            self.waiting.popleft()
            self.running.append(chunk.seq)
            scheduled.append(chunk)
            budget -= chunk.num_tokens
        return scheduled

    def _admit(self, seq: SeqState, budget: int) -> ScheduledChunk | None:
        bs = self.pool.block_size
        # Reuse cached full blocks, but always compute at least the last token (its logits).
        keys = self._full_block_keys(seq, (len(seq.token_ids) - 1) // bs)
        hits = self.pool.lookup(keys)
        start = len(hits) * bs
        n = min(len(seq.token_ids) - start, budget)
        need = blocks_for(start + n, bs) - len(hits)
        idle_hits = sum(1 for b in hits if self.pool.ref_counts[b] == 0)
        if need > self.pool.num_free - idle_hits:
            return None
        self.pool.acquire(hits)
        seq.block_ids = hits + self.pool.allocate(need)
        seq.block_keys = keys[: len(hits)]
        seq.num_computed = start
        seq.cache_epoch = self.pool.epoch
        if seq.first_scheduled is None:
            seq.first_scheduled = time.perf_counter()
            self.num_admitted_prompt_tokens += seq.prompt_len
            self.num_prefix_hit_tokens += start
        return ScheduledChunk(seq, start, n)

    def _full_block_keys(self, seq: SeqState, num_blocks: int) -> list[int]:
        bs = self.pool.block_size
        keys, parent = [], self.pool.root_key()
        for b in range(num_blocks):
            parent = chain_key(parent, seq.token_ids[b * bs:(b + 1) * bs])
            keys.append(parent)
        return keys

    def _preempt(self, seq: SeqState) -> None:
        self.pool.release(seq.block_ids)
        seq.block_ids, seq.block_keys, seq.num_computed, seq.cache_epoch = [], [], 0, -1
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def computed(self, chunk: ScheduledChunk) -> None:
        """Records that the chunk's KV is in the cache and publishes the blocks it filled."""
        seq = chunk.seq
        seq.num_computed += chunk.num_tokens
        if seq.cache_epoch != self.pool.epoch:
            return  # admitted before a weight change: its KV must not serve newer requests
        bs = self.pool.block_size
        parent = seq.block_keys[-1] if seq.block_keys else self.pool.root_key()
        for b in range(len(seq.block_keys), seq.num_computed // bs):
            parent = chain_key(parent, seq.token_ids[b * bs:(b + 1) * bs])
            seq.block_keys.append(parent)
            self.pool.cache(seq.block_ids[b], parent)
