import random

import pytest
import torch

from rlactors.weight_sync.checksum import PERIOD, RunningChecksum, state_checksum, tensor_checksum
from rlactors.weight_sync.packed import PackedLayout


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(17, 33, generator=g),
        "b.bias": torch.randn(7, generator=g).to(torch.bfloat16),
        "c.odd": torch.randint(0, 255, (5,), generator=g, dtype=torch.uint8),  # not a multiple of 4 bytes
    }


def test_same_weights_same_checksum_in_any_order():
    w = _weights()
    assert state_checksum(w) == state_checksum(dict(reversed(list(w.items()))))
    assert state_checksum(w) == state_checksum({k: v.clone() for k, v in w.items()})


def test_a_flipped_value_changes_the_checksum():
    w = _weights()
    flipped = {k: v.clone() for k, v in w.items()}
    flipped["a.weight"][3, 5] = -flipped["a.weight"][3, 5]
    assert state_checksum(flipped) != state_checksum(w)


def test_a_single_bit_flip_changes_the_checksum():
    w = _weights()
    bits = w["b.bias"].clone().view(torch.int16)
    bits[2] ^= 1
    assert state_checksum({**w, "b.bias": bits.view(torch.bfloat16)}) != state_checksum(w)


def test_swapped_values_change_the_checksum():
    t = torch.arange(8, dtype=torch.float32)
    swapped = t.clone()
    swapped[[1, 6]] = swapped[[6, 1]]
    assert tensor_checksum(t)[0] == tensor_checksum(swapped)[0]  # the plain sum cannot see a swap
    assert tensor_checksum(t) != tensor_checksum(swapped)


def test_names_dtypes_and_shapes_count():
    w = _weights()
    assert state_checksum({"x" + k: v for k, v in w.items()}) != state_checksum(w)
    assert state_checksum({**w, "a.weight": w["a.weight"].reshape(33, 17)}) != state_checksum(w)
    assert state_checksum({**w, "a.weight": w["a.weight"].view(torch.int32)}) != state_checksum(w)


def test_non_contiguous_views_hash_their_values():
    t = torch.randn(6, 4)
    assert tensor_checksum(t.t()) == tensor_checksum(t.t().contiguous())


def _random_words(count, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2**31, 2**31, (count,), generator=g, dtype=torch.int32)


def _reference(data: bytes) -> tuple[int, int]:
    """The checksum's definition, word by word in Python ints: 32-bit little-endian signed words,
    zero-padded; word i adds to column i % PERIOD mod 2**32; plain and (column + 1)-weighted sums."""
    data += bytes(-len(data) % 4)
    columns = [0] * PERIOD
    for i in range(0, len(data), 4):
        columns[i // 4 % PERIOD] = (columns[i // 4 % PERIOD] + int.from_bytes(data[i:i + 4], "little")) % 2**32
    signed = [c - 2**32 if c >= 2**31 else c for c in columns]
    mask = 2**64 - 1
    return sum(signed) & mask, sum((c + 1) * v for c, v in enumerate(signed)) & mask


def test_matches_the_word_by_word_definition_including_wrapping_and_odd_byte_counts():
    odd = torch.randint(0, 256, (4 * (2 * PERIOD + 5) + 3,), generator=torch.Generator().manual_seed(1),
                        dtype=torch.uint8)
    assert tensor_checksum(odd) == _reference(bytes(odd.tolist()))
    saturated = torch.full((3 * PERIOD + 1,), 2**31 - 1, dtype=torch.int32)  # every column sum wraps
    assert tensor_checksum(saturated) == _reference(saturated.numpy().tobytes())


def test_a_swap_of_two_unequal_words_inside_a_tensor_is_seen():
    words = _random_words(3 * PERIOD + 11)
    reference = tensor_checksum(words)
    rng = random.Random(0)
    for _ in range(50):
        i, j = rng.sample(range(words.numel()), 2)
        if i % PERIOD == j % PERIOD or words[i] == words[j]:
            continue  # a shared column is the documented blind spot; equal words are no change
        swapped = words.clone()
        swapped[[i, j]] = swapped[[j, i]]
        assert tensor_checksum(swapped) != reference, (i, j)


def test_swapped_blocks_a_power_of_two_apart_are_seen():
    """Transport chunks, shards and rows come in powers of two: the prime period never divides them."""
    words = _random_words(8 * 4096)
    swapped = words.clone().view(8, 4096)
    swapped[[2, 5]] = swapped[[5, 2]]
    assert tensor_checksum(swapped) != tensor_checksum(words)


def test_a_swap_of_unequal_words_across_two_same_shape_tensors_is_seen():
    state = {"a": _random_words(2 * PERIOD, seed=1), "b": _random_words(2 * PERIOD, seed=2)}
    reference = state_checksum(state)
    for i, j in [(5, 5), (5, 900), (PERIOD + 3, 17)]:
        a, b = state["a"].clone(), state["b"].clone()
        a[i], b[j] = state["b"][j], state["a"][i]
        assert state_checksum({"a": a, "b": b}) != reference
    assert state_checksum({"a": state["b"], "b": state["a"]}) != reference


def test_same_shape_tensors_swapped_inside_a_packed_buffer_are_seen():
    w = {f"layers.{i}.up": torch.randn(64, 128).to(torch.bfloat16) for i in range(3)}
    layout = PackedLayout.of(w)
    reference = layout.checksum(layout.pack(w, layout.empty("cpu").zero_()))
    swapped = {**w, "layers.0.up": w["layers.2.up"], "layers.2.up": w["layers.0.up"]}
    assert layout.checksum(layout.pack(swapped, layout.empty("cpu").zero_())) != reference


def test_any_one_bit_flip_in_the_last_word_is_seen_when_the_size_is_not_a_multiple_of_the_period():
    words = _random_words(2 * PERIOD + 7)
    reference = tensor_checksum(words)
    for bit in range(32):
        flipped = words.clone()
        flipped.view(torch.uint8)[-4 + bit // 8] ^= 1 << bit % 8  # little-endian; bit 31 is the sign bit
        assert tensor_checksum(flipped) != reference, bit
    halves = torch.randn(2 * PERIOD + 1).to(torch.bfloat16)  # ends in half a word, padded with zeros
    for bit in range(16):
        flipped = halves.clone()
        flipped.view(torch.uint8)[-2 + bit // 8] ^= 1 << bit % 8
        assert tensor_checksum(flipped) != tensor_checksum(halves), bit


def test_empty_tensors_and_states():
    assert tensor_checksum(torch.empty(0)) == (0, 0)
    state = {"w": torch.randn(3), "empty": torch.empty(0, 4)}
    assert state_checksum(state) == state_checksum({**state, "empty": torch.empty(0, 4)})
    assert state_checksum(state) != state_checksum({**state, "empty": torch.empty(4, 0)})
    assert state_checksum({}) == state_checksum([])


def test_the_digest_is_the_same_for_a_dict_and_any_iteration_order():
    w = {f"t{i}": torch.randn(i + 1) for i in range(8)}
    digest = state_checksum(w)
    items = list(w.items())
    for seed in range(5):
        random.Random(seed).shuffle(items)
        assert state_checksum(items) == digest
        assert state_checksum(iter(items)) == digest


def test_a_view_starting_mid_word_hashes_its_values():
    base = torch.randn(11).to(torch.bfloat16)
    assert tensor_checksum(base[1:9]) == tensor_checksum(base[1:9].clone())


def test_a_whole_state_costs_one_transfer_to_the_host(monkeypatch):
    transfers = []
    for method in ("tolist", "item", "cpu"):
        original = getattr(torch.Tensor, method)
        monkeypatch.setattr(torch.Tensor, method,
                            lambda self, *a, _original=original, _name=method, **k:
                            transfers.append(_name) or _original(self, *a, **k))
    state_checksum({f"t{i}": torch.randn(5, 7) for i in range(20)})
    assert transfers == ["tolist"]


def test_pieces_summed_as_they_come_in_any_order_give_the_whole_buffers_checksum():
    """What each side of a chunked broadcast computes: a piece's sums rotated to its offset."""
    g = torch.Generator().manual_seed(3)
    buffer = torch.randint(0, 256, (3 * 4 * PERIOD + 1000,), dtype=torch.uint8, generator=g)
    cuts = [0, 64, 4 * PERIOD + 8, 2 * 4 * PERIOD, buffer.numel()]  # offsets that are not multiples of a row
    running = RunningChecksum("cpu")
    for start, end in reversed(list(zip(cuts, cuts[1:]))):
        running.add(buffer[start:end], start)
    assert running.sums() == tensor_checksum(buffer)
    shifted = RunningChecksum("cpu")
    shifted.add(buffer[:64], 4)  # the right bytes at the wrong place
    shifted.add(buffer[64:], 64)
    assert shifted.sums() != tensor_checksum(buffer)
    with pytest.raises(ValueError, match="byte_offset must be a multiple of 4, got 6"):
        running.add(buffer[:8], 6)
