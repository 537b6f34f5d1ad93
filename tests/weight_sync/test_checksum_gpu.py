"""On CUDA `RunningChecksum.add` sums a piece with one Triton kernel launch: its columns are
bitwise those of the torch path (`_column_sums`, rotated) on the same GPU, for any size, offset and
dtype, and the pieces of a buffer in any order give the whole buffer's checksum on CPU."""

import random

import pytest
import torch

from rlactors.weight_sync import checksum
from rlactors.weight_sync.checksum import PERIOD, RunningChecksum, tensor_checksum

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROW = 4 * PERIOD  # bytes


@pytest.fixture
def kernel_calls(monkeypatch):
    """The pieces the Triton kernel summed, in order (byte counts)."""
    kernel = checksum._triton()
    assert kernel is not None, "Triton is not importable: the kernel would never run"
    calls = []
    add = kernel.add_column_sums
    monkeypatch.setattr(kernel, "add_column_sums",
                        lambda columns, piece, shift: calls.append(piece.numel()) or add(columns, piece, shift))
    return calls


def _random_bytes(count, seed=0):
    g = torch.Generator("cuda").manual_seed(seed)
    return torch.randint(0, 256, (count,), dtype=torch.uint8, device="cuda", generator=g)


def _added(piece, byte_offset):
    running = RunningChecksum(piece.device)
    running.add(piece, byte_offset)
    return running.columns


def _torch_path(piece, byte_offset):
    return torch.roll(checksum._column_sums(piece), byte_offset // 4 % PERIOD)


OFFSETS = [0, 4, 4 * (PERIOD - 1), 3 << 28]  # the last: the 4th 256 MiB chunk's, not a multiple of a row


@pytest.mark.parametrize("size", [4 * 100, ROW, 4 * ROW, 4 * ROW + 4, 37 * ROW + 4 * 1234, 3 * 32 * 4 * ROW + 20],
                         ids=["under-a-row", "a-row", "a-step", "a-step-and-a-word", "rows-and-a-tail",
                              "steps-for-every-program"])
def test_the_kernel_sums_random_bytes_bitwise_as_the_torch_path(size, kernel_calls):
    piece = _random_bytes(size, seed=size)
    for offset in OFFSETS:
        assert torch.equal(_added(piece, offset), _torch_path(piece, offset)), offset
    assert kernel_calls == [size] * len(OFFSETS)


def test_the_kernel_sums_bf16_views_bitwise_as_the_torch_path(kernel_calls):
    weights = torch.randn(123, 4096, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    weights = weights.to(torch.bfloat16)
    flat = weights.view(-1)
    # a view, one 4-byte aligned but not 16-byte aligned, a transposed one (summed as a copy), and
    # an odd number of bf16 values ending in half a word
    pieces = [weights[5:], flat[2:], weights.t(), flat[:2 * PERIOD + 1]]
    for piece in pieces:
        for offset in OFFSETS:
            assert torch.equal(_added(piece, offset), _torch_path(piece, offset)), (piece.shape, offset)
    assert kernel_calls == [p.numel() * 2 for p in pieces[:3] for _ in OFFSETS]  # half a word: the torch path


def test_a_piece_starting_mid_word_takes_the_torch_path(kernel_calls):
    flat = torch.randn(3 * PERIOD, device="cuda").to(torch.bfloat16)
    assert torch.equal(_added(flat[1:9], 8), _torch_path(flat[1:9].clone(), 8))
    assert kernel_calls == []


def test_a_256_mib_piece_sums_bitwise_as_the_torch_path(kernel_calls):
    piece = _random_bytes(256 << 20, seed=2)
    assert torch.equal(_added(piece, 1 << 28), _torch_path(piece, 1 << 28))
    assert kernel_calls == [256 << 20]


def test_pieces_in_any_order_give_the_whole_buffers_checksum(kernel_calls):
    buffer = _random_bytes(5 * (1 << 20) + 4 * 777, seed=3)
    rng = random.Random(0)
    cuts = sorted({0, buffer.numel(), *(4 * rng.randrange(buffer.numel() // 4) for _ in range(9))})
    pieces = list(zip(cuts, cuts[1:]))
    whole = tensor_checksum(buffer.cpu())  # the definition, summed by torch on CPU
    for seed in range(3):
        random.Random(seed).shuffle(pieces)
        running = RunningChecksum("cuda")
        for start, end in pieces:
            running.add(buffer[start:end], start)
        assert running.sums() == whole
    assert len(kernel_calls) == 3 * len(pieces)
