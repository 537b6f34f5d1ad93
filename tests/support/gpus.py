"""The mark of a test that needs several GPUs."""

from __future__ import annotations

import pytest
import torch


def gpus(n: int):
    """Marks a test that needs ``n`` GPUs (2 or 4): ``gpu`` and ``two_gpus`` / ``four_gpus``, which
    scripts/gpu_suite.py selects by; skips it on fewer GPUs."""
    def mark(test):
        test = pytest.mark.skipif(torch.cuda.device_count() < n, reason=f"needs {n} GPUs")(test)
        return pytest.mark.gpu({2: pytest.mark.two_gpus, 4: pytest.mark.four_gpus}[n](test))
    return mark
