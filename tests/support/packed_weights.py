"""Small weights in chunks, and a trainer's packing of them, for the weight broadcast's tests."""

from __future__ import annotations

import torch

from rlactors.weight_sync.packed import PackedLayout

CHUNK_BYTES = 4096  # the 38 KB embedding goes in 10 chunks


def small_weights(device: torch.device | str = "cpu", scale: float = 1.0) -> dict[str, torch.Tensor]:
    """A bf16 embedding and an fp32 norm, the same at every call, times `scale`, on `device`."""
    g = torch.Generator().manual_seed(0)
    weights = {"embed": torch.randn(300, 64, generator=g).to(torch.bfloat16), "norm": torch.randn(64, generator=g)}
    return {name: (tensor * scale).to(device) for name, tensor in weights.items()}


def pack_from(weights: dict[str, torch.Tensor], layout: PackedLayout):
    """A trainer's `pack` for WeightSender: each chunk's pieces from `weights`, as they are at the call."""
    def pack(chunk, buffer):
        for piece in chunk.pieces:
            layout.piece_view(buffer, piece).copy_(weights[piece.name][piece.first_row:piece.first_row + piece.rows])
    return pack
