"""Episodes -> per-rank microbatches of packed rows.

Each episode of n tokens is one document of n - 1 (input, target) pairs. Documents are packed
into rows of at most `row_tokens` slots by best-fit decreasing (longest first, each into the
fullest row that still has room), so padding is only the unused tail of each row, not a pad per
sample. Rows are spread over DP ranks by tokens (fullest row to the least-loaded rank), so each
rank's rows come fullest first; they are cut into microbatches of at most `rows_per_microbatch`,
the same number on every rank, so every rank runs forward_backward the same number of times.
A microbatch is as wide as its fullest row: the least-filled rows share the last microbatch,
which gets narrower instead of computing columns that are padding in every row.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlactors.config import BatcherConfig
from rlactors.rollout.types import Episode
from rlactors.trainer.batch import MicroBatch, PackedBatch


@dataclass
class _Document:
    episode: Episode
    num_tokens: int  # tokens of the episode that go in (after truncation); targets = num_tokens - 1

    @property
    def num_targets(self) -> int:
        return self.num_tokens - 1


class Batcher:
    def __init__(self, config: BatcherConfig, dp_size: int = 1, pad_token_id: int = 0) -> None:
        if dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        self.config = config
        self.dp_size = dp_size
        self.pad_token_id = pad_token_id

    def pack(self, episodes: Sequence[Episode]) -> PackedBatch:
        docs, truncated, dropped = self._documents(episodes)
        rows = self._pack_rows(docs)
        rank_rows = self._balance(rows)
        # Every rank makes the same number of forward_backward calls: the busiest rank's count of
        # microbatches; the other ranks spread their rows over as many (fewer rows each), and only
        # a rank with fewer rows than calls gets all-padding microbatches.
        num_microbatches = max(math.ceil(len(rr) / self.config.rows_per_microbatch) for rr in rank_rows)
        per_rank = []
        for rows_of_rank in rank_rows:
            chunks = _split_evenly(rows_of_rank, num_microbatches)
            per_rank.append([self._microbatch(chunk if chunk else [[]]) for chunk in chunks])

        slots = sum(mb.input_ids.numel() for mbs in per_rank for mb in mbs)
        real = sum(d.num_targets for d in docs)
        rank_tokens = [sum(d.num_targets for row in rr for d in row) for rr in rank_rows]
        num_loss_tokens = sum(int(mb.loss_mask.sum()) for mbs in per_rank for mb in mbs)
        metrics = {
            "batcher/episodes": float(len(episodes)),
            "batcher/rows": float(len(rows)),
            "batcher/microbatches_per_rank": float(num_microbatches),
            "batcher/tokens": float(real),
            "batcher/loss_tokens": float(num_loss_tokens),
            "batcher/padding_fraction": 1.0 - real / slots if slots else 0.0,
            "batcher/overlong_truncated": float(truncated),
            "batcher/overlong_dropped": float(dropped),
            "batcher/rank_token_imbalance": (max(rank_tokens) / (real / self.dp_size)) if real else 1.0,
        }
        return PackedBatch(per_rank=per_rank, num_loss_tokens=num_loss_tokens,
                           num_sequences=len(docs), metrics=metrics)

    def _documents(self, episodes: Sequence[Episode]) -> tuple[list[_Document], int, int]:
        """Applies the overlong policy; an episode left without a trained target is dropped."""
        budget = self.config.row_tokens
        docs, truncated, dropped = [], 0, 0
        for ep in episodes:
            n = len(ep.token_ids)
            if n - 1 > budget:
                if self.config.overlong == "drop":
                    dropped += 1
                    continue
                n = budget + 1
                truncated += 1
            if not any(ep.loss_mask[1:n]):
                dropped += 1
                continue
            docs.append(_Document(ep, n))
        return docs, truncated, dropped

    def _pack_rows(self, docs: list[_Document]) -> list[list[_Document]]:
        """Best-fit decreasing: each document goes into the row with the least room that fits it."""
        rows: list[list[_Document]] = []
        free: list[tuple[int, int]] = []  # sorted (free slots, row index)
        for doc in sorted(docs, key=lambda d: -d.num_targets):
            i = bisect.bisect_left(free, (doc.num_targets, -1))
            if i < len(free):
                room, row = free.pop(i)
            else:
                room, row = self.config.row_tokens, len(rows)
                rows.append([])
            rows[row].append(doc)
            bisect.insort(free, (room - doc.num_targets, row))
        return rows

    def _balance(self, rows: list[list[_Document]]) -> list[list[list[_Document]]]:
        """Largest row first to the rank with the fewest tokens, at most ceil(rows / dp) rows each."""
        cap = math.ceil(len(rows) / self.dp_size)
        rank_rows: list[list[list[_Document]]] = [[] for _ in range(self.dp_size)]
        rank_tokens = [0] * self.dp_size
        for row in sorted(rows, key=lambda r: -sum(d.num_targets for d in r)):
            rank = min((r for r in range(self.dp_size) if len(rank_rows[r]) < cap),
                       key=lambda r: rank_tokens[r])
            rank_rows[rank].append(row)
            rank_tokens[rank] += sum(d.num_targets for d in row)
        return rank_rows

    def _microbatch(self, rows: list[list[_Document]]) -> MicroBatch:
        # Columns past the fullest row would be padding in every row: they are not kept.
        width = max(1, max(sum(d.num_targets for d in row) for row in rows))
        columns: dict[str, list[list]] = {name: [] for name in _FIELDS}
        for row in rows:
            ids, targets, positions, mask, advantages, logprobs, versions = [], [], [], [], [], [], []
            for doc in row:
                ep, n = doc.episode, doc.num_tokens
                ids += ep.token_ids[:n - 1]
                targets += ep.token_ids[1:n]
                positions += range(n - 1)
                mask += ep.loss_mask[1:n]
                advantages += ep.advantages[1:n]
                logprobs += ep.generator_logprobs[1:n]
                versions += ep.versions[1:n]
            # The unused tail is its own document, so no real token attends to it or it to them.
            pad = width - len(ids)
            ids += [self.pad_token_id] * pad
            targets += [self.pad_token_id] * pad
            positions += range(pad)
            mask += [False] * pad
            advantages += [0.0] * pad
            logprobs += [0.0] * pad
            versions += [-1] * pad
            for name, column in zip(_FIELDS, (ids, positions, targets, mask, advantages, logprobs, versions)):
                columns[name].append(column)
        return MicroBatch(**{name: torch.tensor(columns[name], dtype=dtype) for name, dtype in _FIELDS.items()},
                          routed_experts=_routed_experts(rows, width))


_FIELDS = {  # MicroBatch field -> dtype
    "input_ids": torch.long,
    "positions": torch.long,
    "target_ids": torch.long,
    "loss_mask": torch.bool,
    "advantages": torch.float32,
    "generator_logprobs": torch.float32,
    "versions": torch.long,
}


def _routed_experts(rows: list[list[_Document]], width: int) -> torch.Tensor | None:
    """MicroBatch.routed_experts of these rows (aligned to targets as the logprobs are), or None
    when no episode carries them."""
    known = [e for row in rows for doc in row if doc.episode.routed_experts
             for e in doc.episode.routed_experts if e is not None]
    if not known:
        return None
    out = torch.full((len(rows), width, len(known[0]), len(known[0][0])), -1, dtype=torch.long)
    for r, row in enumerate(rows):
        column = 0
        for doc in row:
            experts = doc.episode.routed_experts or [None] * doc.num_tokens
            for t, entry in enumerate(experts[1:doc.num_tokens]):
                if entry is not None:
                    out[r, column + t] = torch.tensor(entry)
            column += doc.num_tokens - 1
    return out


def _split_evenly(items: list, parts: int) -> list[list]:
    """`items` in `parts` consecutive chunks whose sizes differ by at most one (some empty if too few)."""
    if parts == 0:
        return []
    size, extra = divmod(len(items), parts)
    chunks, start = [], 0
    for i in range(parts):
        end = start + size + (i < extra)
        chunks.append(items[start:end])
        start = end
    return chunks
