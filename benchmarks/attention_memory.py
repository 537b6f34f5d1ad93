"""CPU batch-invariant attention (true on-policy mode) over one long document: seconds per layer
and the process's peak memory, at the Qwen3-0.6B/1.7B head shape (16 query heads, 8 kv heads, 128).

    python benchmarks/attention_memory.py 2048      # one length per process: peak memory is per process

Prints one line; results are kept in benchmarks/results/on_policy_cost_cpu.md.
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from rlactors.on_policy.attention import AttentionPlan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("length", type=int)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    heads, kv_heads, head_dim = 16, 8, 128
    torch.manual_seed(0)
    q = torch.randn(args.length, heads, head_dim)
    k, v = torch.randn(2, 1, kv_heads, args.length, head_dim)
    plan = AttentionPlan(torch.arange(args.length), torch.zeros(args.length, dtype=torch.long))
    plan(q, k, v)  # builds the plan's reads, as a step's first layer does
    start = time.perf_counter()
    for _ in range(args.repeats):
        plan(q, k, v)
    seconds = (time.perf_counter() - start) / args.repeats
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"length {args.length}: {seconds:.3f} s per layer, peak memory {peak_mb:.0f} MB "
          f"({torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
