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
