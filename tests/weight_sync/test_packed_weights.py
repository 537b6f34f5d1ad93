import pytest
import torch

from rlactors.weight_sync.packed import PackedLayout


def _weights():
    g = torch.Generator().manual_seed(0)
    return {"embed": torch.randn(7, 5, generator=g).to(torch.bfloat16), "norm": torch.randn(3, generator=g),
            "proj": torch.randn(4, 6, generator=g).to(torch.bfloat16)}


def test_pack_then_views_round_trip_bitwise_and_aligned():
    w = _weights()
    layout = PackedLayout.of(w)
    buffer = layout.pack(w, layout.empty("cpu").zero_())
    views = dict(layout.views(buffer))
    assert list(views) == list(w)
    for name, tensor in w.items():
        assert torch.equal(views[name], tensor) and views[name].dtype == tensor.dtype
    assert all(s.offset % 64 == 0 for s in layout.specs)


def test_checksum_sees_a_flipped_value_and_the_layout():
    w = _weights()
    layout = PackedLayout.of(w)
    buffer = layout.pack(w, layout.empty("cpu").zero_())
    reference = layout.checksum(buffer)
    assert layout.checksum(buffer.clone()) == reference
    corrupted = buffer.clone()
    dict(layout.views(corrupted))["proj"][1, 2] *= -1
    assert layout.checksum(corrupted) != reference
    renamed = PackedLayout.of({("x" + k): v for k, v in w.items()})
    assert renamed.checksum(buffer) != reference


def test_mismatched_weights_are_refused():
    w = _weights()
    layout = PackedLayout.of(w)
    with pytest.raises(ValueError, match=r"missing \['norm'\]"):
        layout.pack({k: v for k, v in w.items() if k != "norm"}, layout.empty("cpu"))
    with pytest.raises(ValueError, match="proj: .* layout has"):
        layout.pack({**w, "proj": w["proj"].float()}, layout.empty("cpu"))
    with pytest.raises(ValueError, match="buffer must be"):
        layout.views(torch.empty(3, dtype=torch.uint8))


def test_chunks_cover_the_buffer_in_order_cut_between_rows_and_every_row_is_in_one_piece():
    g = torch.Generator().manual_seed(1)
    w = {"norm": torch.randn(5, generator=g), "embed": torch.randn(100, 32, generator=g).to(torch.bfloat16),
         "odd": torch.randn(9, 3, generator=g).to(torch.bfloat16), "proj": torch.randn(40, 16, generator=g)}
    layout = PackedLayout.of(w, chunk_bytes=1024)
    buffer = layout.pack(w, layout.empty("cpu").zero_())
    chunks = layout.chunks
    assert chunks[0].start == 0 and chunks[-1].end == layout.total_bytes
    assert all(a.end == b.start for a, b in zip(chunks, chunks[1:])) and all(c.start % 64 == 0 for c in chunks)
    # At most 1024 bytes of rows each (plus padding); the 64-byte rows of the embedding are cut
    # across chunks, the 6-byte rows of `odd` and the 4-byte rows of `norm` (not multiples of the
    # alignment) are not.
    assert all(sum(layout.piece_view(buffer, p).nbytes for p in c.pieces) <= 1024 for c in chunks)
    assert [(p.first_row, p.rows) for c in chunks for p in c.pieces if p.name == "embed"] == \
        [(0, 15), (15, 16), (31, 16), (47, 16), (63, 16), (79, 16), (95, 5)]
    assert [(p.first_row, p.rows) for c in chunks for p in c.pieces if p.name == "odd"] == [(0, 9)]
    assert [(p.first_row, p.rows) for c in chunks for p in c.pieces if p.name == "norm"] == [(0, 5)]
    for name, tensor in w.items():
        pieces = [p for c in chunks for p in c.pieces if p.name == name]
        rows = [layout.piece_view(buffer, p) for p in pieces]
        assert torch.equal(torch.cat(rows), tensor)
    assert len(PackedLayout.of(w).chunks) == 1
