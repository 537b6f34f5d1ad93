"""Triton kernels behind ``rlactors.models.batch_invariant`` on CUDA.

Each kernel fixes its tile shape at compile time and sums every reduction in one fixed order, so
a row's value is computed by the same instructions in the same order however many rows the launch
has (cuBLAS and torch's CUDA reductions choose split-K and block sizes from the shape, which is
what changes a row's bits with the batch). A row's program reads only that row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MATMUL_BLOCK_M, MATMUL_BLOCK_N, MATMUL_BLOCK_K = 64, 64, 64
MATMUL_WARPS, MATMUL_STAGES = 4, 3
# K is summed in chunks of this many columns, each from zero, and the chunk sums are added in
# order: the same sum whether one program runs the chunks in turn or each chunk has its own.
MATMUL_CHUNK_K = 256
# Below this many output tiles the chunks run in programs of their own, so that small-M
# products (decode steps) still fill the GPU.
MATMUL_MIN_TILES = 264
ROW_BLOCK = 1024  # columns per step of the row kernels


@triton.jit
def _chunk_sum(x_ptr, w_ptr, rows, cols, k_start, k_end, M, N, stride_xm, stride_xk, stride_wn, stride_wk,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """fp32 sum over ``k_start <= k < k_end`` of x[rows, k] * w[cols, k], in order, from zero."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :] * stride_xk,
                    mask=(rows[:, None] < M) & (ks[None, :] < k_end), other=0.0)
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk,
                    mask=(cols[None, :] < N) & (ks[:, None] < k_end), other=0.0)
        if IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    return acc


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, out_ptr, M, N, K,
                   stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK_K: tl.constexpr,
                   IEEE: tl.constexpr):
    """One output tile: every chunk of K in turn, each summed from zero, added in order. One loop
    over K (the compiler pipelines its loads), whose sum is added to the total and restarted at
    each chunk's end: ``_chunk_sum``'s sums, added as ``_sum_chunks_kernel`` adds them."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :] * stride_xk,
                    mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk,
                    mask=(cols[None, :] < N) & (ks[:, None] < K), other=0.0)
        if IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
        chunk_end = ((k0 + BLOCK_K) % CHUNK_K == 0) | (k0 + BLOCK_K >= K)
        total = tl.where(chunk_end, total + acc, total)
        acc = tl.where(chunk_end, 0.0, acc)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_on,
             total.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _matmul_chunk_kernel(x_ptr, w_ptr, partial_ptr, M, N, K,
                         stride_xm, stride_xk, stride_wn, stride_wk,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         CHUNK_K: tl.constexpr, IEEE: tl.constexpr):
    """One output tile's sum over one chunk of K, into ``partial[chunk]`` (fp32, [chunks, M, N])."""
    pid_m, pid_n, chunk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = chunk * CHUNK_K
    acc = _chunk_sum(x_ptr, w_ptr, rows, cols, k_start, tl.minimum(k_start + CHUNK_K, K), M, N,
                     stride_xm, stride_xk, stride_wn, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, IEEE)
    offsets = chunk.to(tl.int64) * M * N + rows[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(partial_ptr + offsets, acc, mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _sum_chunks_kernel(partial_ptr, out_ptr, total_elements, chunks, BLOCK: tl.constexpr):
    """out = partial[0] + partial[1] + ... in order, as ``_matmul_kernel`` adds its chunks."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < total_elements
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for chunk in range(0, chunks):
        total += tl.load(partial_ptr + chunk.to(tl.int64) * total_elements + offsets, mask=mask, other=0.0)
    tl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty), mask=mask)


def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x[M, K] @ weight[N, K].T`` in ``x``'s dtype, fp32 accumulation (IEEE fp32 for fp32).

    K is summed in chunks of ``MATMUL_CHUNK_K``, each from zero with the same tile shape and
    instructions, and the chunk sums are added in order. With many output tiles one program runs
    every chunk of its tile; with few (small M) each chunk runs in a program of its own and a
    second kernel adds them: the same additions in the same order, so the same bits.
    """
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    tiles = (triton.cdiv(m, MATMUL_BLOCK_M), triton.cdiv(n, MATMUL_BLOCK_N))
    chunks = triton.cdiv(k, MATMUL_CHUNK_K)
    shape = dict(BLOCK_M=MATMUL_BLOCK_M, BLOCK_N=MATMUL_BLOCK_N, BLOCK_K=MATMUL_BLOCK_K, CHUNK_K=MATMUL_CHUNK_K,
                 IEEE=x.dtype == torch.float32, num_warps=MATMUL_WARPS, num_stages=MATMUL_STAGES)
    if chunks == 1 or tiles[0] * tiles[1] >= MATMUL_MIN_TILES:
        _matmul_kernel[tiles](x, weight, out, m, n, k, x.stride(0), x.stride(1), weight.stride(0),
                              weight.stride(1), out.stride(0), out.stride(1), **shape)
        return out
    partial = torch.empty(chunks, m, n, dtype=torch.float32, device=x.device)
    _matmul_chunk_kernel[(*tiles, chunks)](x, weight, partial, m, n, k, x.stride(0), x.stride(1),
                                           weight.stride(0), weight.stride(1), **shape)
    block = 1024
    _sum_chunks_kernel[(triton.cdiv(m * n, block),)](partial, out, m * n, chunks, BLOCK=block)
    return out


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, N, stride_x, stride_out, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    squares = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, N, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < N, other=0.0).to(tl.float32)
        squares += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / N + eps)
    for c0 in range(0, N, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < N, other=0.0)
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0)
        normed = (x.to(tl.float32) * rstd).to(x.dtype)
        scaled = w.to(tl.float32) * normed.to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, scaled.to(out_ptr.dtype.element_ty),
                 mask=cols < N)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.shape[1], rows.stride(0), out.stride(0), eps,
                                           BLOCK=min(ROW_BLOCK, triton.next_power_of_2(rows.shape[1])))
    return out.view(*x.shape[:-1], x.shape[-1])


@triton.jit
def _logsumexp_kernel(x_ptr, out_ptr, N, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    # Per-lane running max and sum over the blocks, combined once at the end: a fixed order.
    lane_max = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    lane_sum = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, N, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < N, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(lane_max, x)
        safe = tl.where(new_max == float("-inf"), 0.0, new_max)
        lane_sum = lane_sum * tl.exp(lane_max - safe) + tl.exp(x - safe)
        lane_max = new_max
    row_max = tl.max(lane_max, axis=0)
    safe = tl.where(lane_max == float("-inf"), 0.0, tl.exp(lane_max - row_max))
    tl.store(out_ptr + row, row_max + tl.log(tl.sum(lane_sum * safe, axis=0)))


def logsumexp(x: torch.Tensor) -> torch.Tensor:
    """fp32 logsumexp over the last dim of an fp32 tensor."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        _logsumexp_kernel[(rows.shape[0],)](rows, out, rows.shape[1], rows.stride(0), BLOCK=ROW_BLOCK)
    return out.view(x.shape[:-1])
