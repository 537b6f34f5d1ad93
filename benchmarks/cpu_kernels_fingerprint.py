"""The bits of the CPU true on-policy kernels on this machine, as one hash per kernel, to compare
across machines (CPU vendors, instruction sets, compilers): equal hashes, equal bits.

    python benchmarks/cpu_kernels_fingerprint.py

Inputs are made from integers (exact on every machine, unlike a float RNG's vectorized paths):
a Qwen3-0.6B-shaped q/k/v projection of 300 rows and causal attention over documents of 1 to 700
tokens (16 query heads, 8 kv heads, head dim 128).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from results_table import cpu_model  # noqa: E402  (this script's directory is on sys.path)

from rlactors.on_policy import cpu_kernels  # noqa: E402


def values(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Deterministic fp32 values in about [-1, 1) with full 24-bit mantissas, from integers."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**23), 2**23, shape, generator=gen, dtype=torch.int64).double().div(2**23).float()


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()[:16]


def main() -> None:
    cpu = cpu_model()
    compiler = subprocess.run([os.environ.get("CC", "cc"), "--version"], capture_output=True,
                              text=True).stdout.splitlines()[0]
    matmul = cpu_kernels.matmul(values((300, 1024), 0), values((1024, 4096), 1))
    lengths = [1, 17, 64, 65, 300, 700]
    segments = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    positions = torch.cat([torch.arange(n) for n in lengths])
    key_slots = torch.arange(len(lengths) * 700).view(len(lengths), 700)
    attention = cpu_kernels.attend(values((len(positions), 16, 128), 2), values((2, 8, len(lengths) * 700, 128), 3),
                                   key_slots, segments, positions)
    print(f"cpu: {cpu}; compiler: {compiler}; torch {torch.__version__}")
    print(f"matmul [300, 1024] x [1024, 4096]: {digest(matmul)}")
    print(f"attend {sum(lengths)} queries: {digest(attention)}")


if __name__ == "__main__":
    main()
