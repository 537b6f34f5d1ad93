"""The batch-invariant CUDA matmul (rlactors/on_policy/ops_triton.py) against cuBLAS.

For the linear layers of the Qwen3-0.6B and 1.7B shapes, at decode sizes (M = 1 .. 256) and
prefill/training sizes (M = 2048, 8192, 16384): time per call, replayed from a CUDA graph as vLLM
runs decode steps, and the ratio to torch's cuBLAS matmul. The kernel is also checked for its
promise: each row of an M = 8192 product has the bits of the same row computed in smaller
batches, at other offsets (its three launches: large tiles, small tiles, chunks in programs of
their own). Other designs and tile shapes: benchmarks/results/notes/batch_invariant_matmul_designs.md.

    python benchmarks/batch_invariant_matmul.py [--out FILE]

Prints the per-shape table and adds a row to results/batch_invariant_matmul_gpu.md (or FILE).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from results_table import RESULTS, append_row

COLUMNS = ("rows invariant", "decode sizes: ours / cuBLAS (geomean)", "prefill sizes: ours / cuBLAS (geomean)",
           "M=16384: ours / cuBLAS per shape")

SHAPES = {  # name: (N, K) of x[M, K] @ w[N, K].T
    "0.6b qkv (q)": (2048, 1024), "0.6b o": (1024, 2048), "0.6b gate/up": (3072, 1024), "0.6b down": (1024, 3072),
    "1.7b gate/up": (6144, 2048), "1.7b down": (2048, 6144),
}
DECODE_M, PREFILL_M = (1, 16, 64, 128, 256), (2048, 8192, 16384)


def graph_time(fn, calls: int = 20, replays: int = 10) -> float:
    """Seconds per call of fn, from a CUDA graph of `calls` calls replayed `replays` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / (calls * replays)


def rows_invariant(matmul, n: int, k: int) -> bool:
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", generator=g).bfloat16()
    x = torch.randn(8192, k, device="cuda", generator=g).bfloat16()
    full = matmul(x, w)
    return all(torch.equal(matmul(x[o:o + m], w), full[o:o + m])
               for o, m in ((0, 1), (5, 1), (3, 7), (100, 64), (1, 256), (17, 1000), (0, 1200), (0, 4096)))


def measure() -> dict:
    from rlactors.on_policy import ops_triton as bit

    out = {"invariant": all(rows_invariant(bit.matmul, n, k) for n, k in SHAPES.values()), "ratios": {}}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda").bfloat16()
        for m in DECODE_M + PREFILL_M:
            x = torch.randn(m, k, device="cuda").bfloat16()
            ours = graph_time(lambda x=x, w=w: bit.matmul(x, w))
            cublas = graph_time(lambda x=x, w=w: torch.matmul(x, w.T))
            out["ratios"][(name, m)] = (ours, cublas)
    return out


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS / "batch_invariant_matmul_gpu.md")
    args = parser.parse_args()
    result = measure()
    ratios = result["ratios"]
    decode = geomean(o / c for (_, m), (o, c) in ratios.items() if m in DECODE_M)
    prefill = geomean(o / c for (_, m), (o, c) in ratios.items() if m in PREFILL_M)
    lines = [f"# Batch-invariant matmul vs cuBLAS ({torch.cuda.get_device_name()})", "",
             f"torch {torch.__version__}; bf16 inputs, fp32 accumulation. Time per call from CUDA-graph replay "
             "(20 calls x 10 replays); ratio = ours / cuBLAS (torch.matmul).", "",
             f"Rows invariant: {result['invariant']}. Geometric mean of the ratios: decode sizes "
             f"(M = {', '.join(map(str, DECODE_M))}) {decode:.2f}x, prefill sizes "
             f"(M = {', '.join(map(str, PREFILL_M))}) {prefill:.2f}x.", "",
             "Microseconds, ours / cuBLAS:", "",
             "| shape | " + " | ".join(f"M={m}" for m in DECODE_M + PREFILL_M) + " |",
             "|---|" + "---|" * len(DECODE_M + PREFILL_M)]
    for name in SHAPES:
        cells = [f"{ratios[(name, m)][0] * 1e6:.1f} / {ratios[(name, m)][1] * 1e6:.1f}" for m in DECODE_M + PREFILL_M]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    largest = ", ".join(f"{name} {ratios[(name, PREFILL_M[-1])][0] / ratios[(name, PREFILL_M[-1])][1]:.2f}x"
                        for name in SHAPES)
    append_row(args.out, "Batch-invariant matmul vs cuBLAS", COLUMNS,
               [result["invariant"], f"{decode:.2f}x", f"{prefill:.2f}x", largest], device="cuda")
    print(f"added a row to {args.out}")


if __name__ == "__main__":
    main()
