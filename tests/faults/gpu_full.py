"""An actor that fails as a trainer rank whose GPU is full, for procs that cannot import tests/:
cloudpickle ships this module's classes by value."""

from __future__ import annotations

import sys
from typing import Any

import cloudpickle
import torch
from monarch.actor import Actor, endpoint

# torch's message for a CUDA allocation that did not fit (its first sentences are what a run says)
TORCH_OUT_OF_MEMORY = ("CUDA out of memory. Tried to allocate 2.66 GiB. GPU 0 has a total capacity of 139.81 GiB of "
                       "which 1.92 GiB is free. Including non-PyTorch memory, this process has 137.86 GiB memory in "
                       "use. Of the allocated memory 120.02 GiB is allocated by PyTorch, and 15.21 GiB is reserved by "
                       "PyTorch but unallocated.")


class GpuFullTrainer(Actor):
    """A trainer rank whose GPU is full: its forward_backward raises torch's OutOfMemoryError."""

    @endpoint
    async def forward_backward(self, *_: Any) -> None:
        raise torch.OutOfMemoryError(TORCH_OUT_OF_MEMORY)


cloudpickle.register_pickle_by_value(sys.modules[__name__])
