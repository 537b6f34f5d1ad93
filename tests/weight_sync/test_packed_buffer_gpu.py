"""On a GPU, the sender's and the receivers' weight buffers stay out of the caching allocator's
expandable segments even in a process that turned them on (the trainer's copy engine writes
slower into a mapped one), and the process's setting is left as it was."""

from __future__ import annotations

import pytest
import torch

from rlactors.weight_sync.broadcast import BufferReceiver, WeightSender, expandable_segments
from rlactors.weight_sync.packed import PackedLayout

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _segment(tensor: torch.Tensor) -> dict:
    address = tensor.data_ptr()
    for segment in torch.cuda.memory_snapshot():
        if segment["address"] <= address < segment["address"] + segment["total_size"]:
            return segment
    raise AssertionError("no segment of the caching allocator holds the tensor")


def test_weight_buffers_are_outside_expandable_segments_and_the_setting_is_kept():
    device = torch.device("cuda", torch.cuda.current_device())
    # 4 MiB: a block of the allocator's large pool, where expandable segments grow.
    layout = PackedLayout.of({"w": torch.empty(1024, 2048, dtype=torch.bfloat16, device="meta")})
    original = expandable_segments()
    torch.cuda.empty_cache()  # no free block cached from before may serve the allocations below
    torch._C._accelerator_setAllocatorSettings("expandable_segments:True")
    try:
        elsewhere = layout.empty(device)
        sender, receiver = WeightSender(layout, device), BufferReceiver(layout, device)
        assert _segment(elsewhere)["is_expandable"]
        assert not _segment(sender.buffer)["is_expandable"]
        assert not _segment(receiver.buffer)["is_expandable"]
        assert expandable_segments()
    finally:
        torch._C._accelerator_setAllocatorSettings(f"expandable_segments:{original}")
        elsewhere = sender = receiver = None
        torch.cuda.empty_cache()
