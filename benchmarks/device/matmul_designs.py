"""Designs for the batch-invariant CUDA matmul, side by side with cuBLAS and the current kernel
(GPU). For each design and tile configuration: time per call (CUDA-graph replay) at the linear
shapes of Qwen3-0.6B/1.7B, decode sizes M = 1..256 and training sizes M = 2048..16384, and
whether every row has the bits of the same row computed alone and in other batches (across the
design's launch paths). Also which configurations give the same bits as each other.

    python benchmarks/device/matmul_designs.py

Designs:
- ``current``: rlactors.on_policy.ops_triton.matmul.
- ``nested``: K chunks in an outer loop, each summed from zero in an inner loop, added in
  order (the current kernel's sums, without a select over the tile every step); grouped tile
  order; small M splits chunks over programs as now.
- ``flat``: one loop over K, the chunk sum added and reset in a branch at each chunk's end.
- ``whole``: the whole K in one loop (no chunks); small M runs smaller N tiles instead of
  splitting K. Valid only if tile shapes do not change a row's bits (checked).
"""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from batch_invariant_matmul import graph_time, rows_invariant  # noqa: E402

from rlactors.on_policy import ops_triton as bit  # noqa: E402

SHAPES = {"0.6b q": (2048, 1024), "0.6b o": (1024, 2048), "0.6b gate+up": (6144, 1024), "0.6b down": (1024, 3072),
          "1.7b gate+up": (12288, 2048), "1.7b down": (2048, 6144), "0.6b lm_head": (151936, 1024)}
DECODE_M, TRAIN_M = (1, 16, 64, 256), (2048, 16384)


@triton.jit
def _tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * tiles_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % in_group) % size_m, (pid % in_group) // size_m


@triton.jit
def _nested_kernel(x_ptr, w_ptr, out_ptr, M, N, K, sxm, swn, som,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, FLAT: tl.constexpr):
    pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_in, cols_in = rows % M, cols % N  # loads stay in bounds; the store is masked
    x_base = x_ptr + rows_in[:, None].to(tl.int64) * sxm
    w_base = w_ptr + cols_in[None, :].to(tl.int64) * swn
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FLAT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            acc = tl.dot(tl.load(x_base + ks[None, :]), tl.load(w_base + ks[:, None]), acc)
            if ((k0 + BLOCK_K) % CHUNK_K == 0) | (k0 + BLOCK_K >= K):
                total += acc
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        for c0 in range(0, K, CHUNK_K):
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(c0, tl.minimum(c0 + CHUNK_K, K), BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                acc = tl.dot(tl.load(x_base + ks[None, :]), tl.load(w_base + ks[:, None]), acc)
            total += acc
    tl.store(out_ptr + rows[:, None].to(tl.int64) * som + cols[None, :], total.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _chunk_kernel(x_ptr, w_ptr, partial_ptr, M, N, K, sxm, swn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK_K: tl.constexpr):
    pid_m, pid_n, chunk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    x_base = x_ptr + (rows % M)[:, None].to(tl.int64) * sxm
    w_base = w_ptr + (cols % N)[None, :].to(tl.int64) * swn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(chunk * CHUNK_K, tl.minimum(chunk * CHUNK_K + CHUNK_K, K), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        acc = tl.dot(tl.load(x_base + ks[None, :]), tl.load(w_base + ks[:, None]), acc)
    tl.store(partial_ptr + chunk.to(tl.int64) * M * N + rows[:, None].to(tl.int64) * N + cols[None, :], acc,
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def chunked(bm, bn, bk, chunk, warps, stages, group, min_tiles, flat=False):
    def matmul(x, w):
        m, k = x.shape
        n = w.shape[0]
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        tiles_m, tiles_n = triton.cdiv(m, bm), triton.cdiv(n, bn)
        chunks = triton.cdiv(k, chunk)
        if chunks == 1 or tiles_m * tiles_n >= min_tiles:
            _nested_kernel[(tiles_m * tiles_n,)](x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
                                                 BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, CHUNK_K=chunk, GROUP_M=group,
                                                 FLAT=flat, num_warps=warps, num_stages=stages)
            return out
        partial = torch.empty(chunks, m, n, dtype=torch.float32, device=x.device)
        _chunk_kernel[(tiles_m, tiles_n, chunks)](x, w, partial, m, n, k, x.stride(0), w.stride(0), BLOCK_M=bm,
                                                  BLOCK_N=bn, BLOCK_K=bk, CHUNK_K=chunk, num_warps=warps,
                                                  num_stages=stages)
        bit._sum_chunks_kernel[(triton.cdiv(m * n, 1024),)](partial, out, out, m * n, chunks, BLOCK=1024,
                                                               HAS_RESIDUAL=False)
        return out
    return matmul


def whole(big, small, small_below):
    """Whole K per program: tile config ``big`` (bm, bn, bk, warps, stages, group) for M >=
    ``small_below``, ``small`` below it."""
    def matmul(x, w):
        m, k = x.shape
        n = w.shape[0]
        bm, bn, bk, warps, stages, group = big if m >= small_below else small
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
        _nested_kernel[grid](x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0), BLOCK_M=bm, BLOCK_N=bn,
                             BLOCK_K=bk, CHUNK_K=k, GROUP_M=group, FLAT=False, num_warps=warps, num_stages=stages)
        return out
    return matmul


def designs():
    out = {"current": bit.matmul}
    for bm, bn, warps, stages, chunk in itertools.product((64, 128), (64, 128, 256), (4, 8), (3, 4), (256, 512)):
        if (bm, bn) == (64, 256) or (bm * bn >= 128 * 128) != (warps == 8):
            continue
        out[f"nested {bm}x{bn}x64 c{chunk} w{warps} s{stages}"] = chunked(bm, bn, 64, chunk, warps, stages, 8, 264)
    out["flat 128x128x64 c256 w8 s3"] = chunked(128, 128, 64, 256, 8, 3, 8, 264, flat=True)
    out["flat 128x256x64 c512 w8 s3"] = chunked(128, 256, 64, 512, 8, 3, 8, 264, flat=True)
    out["whole 128x128 / 64x32 below 512"] = whole((128, 128, 64, 8, 3, 8), (64, 32, 64, 4, 4, 1), 512)
    out["whole 128x256 / 64x64 below 512"] = whole((128, 256, 64, 8, 3, 8), (64, 64, 64, 4, 4, 1), 512)
    out["whole 128x128 only"] = whole((128, 128, 64, 8, 3, 8), (128, 128, 64, 8, 3, 8), 0)
    return out


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(map(math.log, values)) / len(values))


def main() -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    g = torch.Generator(device="cuda").manual_seed(1)
    probe_x = torch.randn(3000, 2048, device="cuda", generator=g).bfloat16()
    probe_w = torch.randn(1024, 2048, device="cuda", generator=g).bfloat16()
    bits = {}
    print("| design | rows invariant | decode / cuBLAS | train / cuBLAS | train M=16384 per shape |", flush=True)
    for name, matmul in designs().items():
        try:
            invariant = all(rows_invariant(matmul, n, k) for n, k in list(SHAPES.values())[:6])
            bits[name] = matmul(probe_x, probe_w)
            decode, train, per_shape = [], [], []
            for shape, (n, k) in SHAPES.items():
                w = torch.randn(n, k, device="cuda").bfloat16()
                for m in DECODE_M + TRAIN_M:
                    if shape.endswith("lm_head") and m in DECODE_M[:-1]:
                        continue
                    x = torch.randn(m, k, device="cuda").bfloat16()
                    ours = graph_time(lambda x=x, w=w, matmul=matmul: matmul(x, w), calls=10, replays=5)
                    cublas = graph_time(lambda x=x, w=w: torch.matmul(x, w.T), calls=10, replays=5)
                    (decode if m in DECODE_M else train).append(ours / cublas)
                    if m == TRAIN_M[-1]:
                        per_shape.append(f"{shape} {ours / cublas:.2f}")
            print(f"| {name} | {invariant} | {geomean(decode):.2f}x | {geomean(train):.2f}x | "
                  f"{', '.join(per_shape)} |", flush=True)
        except (CompilationError, OutOfResources) as e:  # a configuration the compiler rejects: reported
            print(f"| {name} | failed: {type(e).__name__}: {str(e)[:120]} |", flush=True)
    groups: list[list[str]] = []
    for name, value in bits.items():
        for group in groups:
            if torch.equal(bits[group[0]], value):
                group.append(name)
                break
        else:
            groups.append([name])
    print("\nConfigurations with the same bits (x[3000, 2048] @ w[1024, 2048].T):")
    for group in groups:
        print(" -", "; ".join(group))


if __name__ == "__main__":
    main()
