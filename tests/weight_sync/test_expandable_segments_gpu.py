"""On a GPU, `in_expandable_segment` tells where the caching allocator put a tensor: in an
expandable segment under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, else not. Each setting
in a process of its own, as a replica's is."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# 4 MiB: a block of the allocator's large pool, where expandable segments grow.
PLACED = """
import torch
from rlactors.weight_sync.broadcast import in_expandable_segment
print(in_expandable_segment(torch.empty(4 << 20, dtype=torch.uint8, device="cuda")))
"""


@pytest.mark.parametrize("alloc_conf, expandable", [("", False), ("expandable_segments:True", True)])
def test_in_expandable_segment_follows_the_allocator_setting(alloc_conf, expandable):
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": alloc_conf}
    placed = subprocess.run([sys.executable, "-c", PLACED], env=env, capture_output=True, text=True, timeout=120)
    assert placed.returncode == 0, placed.stderr
    assert placed.stdout.split() == [str(expandable)]
