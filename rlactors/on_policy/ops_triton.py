"""Triton kernels behind ``rlactors.on_policy.ops`` on CUDA.

Each kernel sums every reduction in one fixed order, so a row's value is computed by the same
additions in the same order however many rows the launch has (cuBLAS and torch's CUDA reductions
choose split-K and block sizes from the shape, which is what changes a row's bits with the batch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# A row's bits depend on how K is summed, not on the tile shape (measured across tile shapes, warps
# and pipeline stages: benchmarks/results/notes/batch_invariant_matmul_designs.md): every launch sums K in
# blocks of MATMUL_BLOCK_K, in chunks of MATMUL_CHUNK_K columns, each chunk from zero, the chunk
# sums added in order. So each launch picks the tile shape that suits its size.
MATMUL_BLOCK_K = 64
MATMUL_CHUNK_K = 256
SMALL_TILE = (64, 64, 4, 3)  # BLOCK_M, BLOCK_N, warps, stages
LARGE_TILE = (128, 128, 8, 3)  # bf16/fp16 products with at least LARGE_MIN_TILES of these tiles
LARGE_MIN_TILES = 128
# Below this many small tiles the chunks run in programs of their own, so that small-M products
# (decode steps) still fill the GPU.
SPLIT_BELOW_TILES = 264
ROW_BLOCK = 1024  # columns per step of the row kernels


@triton.jit
def _load_block(x_ptr, w_ptr, rows, cols, k0, M, N, K, stride_xm, stride_xk, stride_wn, stride_wk,
                BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, MASK_ROWS: tl.constexpr):
    """x[rows, k0:k0+BLOCK_K] and w[cols, k0:k0+BLOCK_K].T. Rows and columns past M and N read row
    and column ``% M``, ``% N`` (in bounds; their results are not stored), or with ``MASK_ROWS``
    zeros: no memory traffic for the unused rows of a tile when M is far below BLOCK_M."""
    ks = k0 + tl.arange(0, BLOCK_K)
    x_mask = ks[None, :] < K
    w_mask = ks[:, None] < K
    if MASK_ROWS:
        x_mask = x_mask & (rows[:, None] < M)
        w_mask = w_mask & (cols[None, :] < N)
    else:
        rows, cols = rows % M, cols % N
    x_at = x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :] * stride_xk
    w_at = w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk
    if EVEN_K and not MASK_ROWS:
        return tl.load(x_at), tl.load(w_at)
    return tl.load(x_at, mask=x_mask, other=0.0), tl.load(w_at, mask=w_mask, other=0.0)


@triton.jit
def _dot(x, w, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(x, w, acc, input_precision="ieee")
    return tl.dot(x, w, acc)


@triton.jit
def _plus_residual(result, residual_ptr, offsets, mask, HAS_RESIDUAL: tl.constexpr):
    """``result`` (rounded to the output dtype) plus the residual at ``offsets``, rounded again:
    the bits of eager torch's ``residual + result``."""
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + offsets, mask=mask, other=0.0)
        result = (result.to(tl.float32) + residual.to(tl.float32)).to(result.dtype)
    return result


@triton.jit
def _tile_sum(x_ptr, w_ptr, rows, cols, M, N, K, stride_xm, stride_xk, stride_wn, stride_wk,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK_K: tl.constexpr,
              EVEN_K: tl.constexpr, IEEE: tl.constexpr, MASK_ROWS: tl.constexpr):
    """``x[rows] @ w[cols].T`` in fp32 (rows past M and columns past N as ``_load_block`` reads
    them): every chunk of K in turn, each summed from zero in blocks, the chunk sums added in
    order. The one order in which every launch of the batch-invariant matmul sums a row."""
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x, w = _load_block(x_ptr, w_ptr, rows, cols, k0, M, N, K, stride_xm, stride_xk, stride_wn, stride_wk,
                           BLOCK_K, EVEN_K, MASK_ROWS)
        acc = _dot(x, w, acc, IEEE)
        # A branch, not a select over the tile: the accumulator is read only at a chunk's end.
        if ((k0 + BLOCK_K) % CHUNK_K == 0) | (k0 + BLOCK_K >= K):
            total += acc
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    return total


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, out_ptr, residual_ptr, M, N, K, stride_xm, stride_xk, stride_wn, stride_wk,
                   stride_om, stride_on, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   CHUNK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
                   HAS_RESIDUAL: tl.constexpr):
    """One output tile: every chunk of K in turn, each summed from zero, added in order
    (``_matmul_chunk_kernel``'s sums, added as ``_sum_chunks_kernel`` adds them). Tiles go in
    groups of GROUP_M rows of tiles, so that programs running together share weight columns.
    ``residual`` (laid out as ``out``) is added to the rounded result when given."""
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    first_m = (pid // (GROUP_M * tiles_n)) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % group_rows
    pid_n = (pid % (GROUP_M * tiles_n)) // group_rows
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    total = _tile_sum(x_ptr, w_ptr, rows, cols, M, N, K, stride_xm, stride_xk, stride_wn, stride_wk,
                      BLOCK_M, BLOCK_N, BLOCK_K, CHUNK_K, EVEN_K, IEEE, False)
    offsets = rows[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_on
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    result = _plus_residual(total.to(out_ptr.dtype.element_ty), residual_ptr, offsets, mask, HAS_RESIDUAL)
    tl.store(out_ptr + offsets, result, mask=mask)


@triton.jit
def _matmul_chunk_kernel(x_ptr, w_ptr, partial_ptr, M, N, K, stride_xm, stride_xk, stride_wn, stride_wk,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         CHUNK_K: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr):
    """One output tile's sum over one chunk of K, from zero, into ``partial[chunk]`` (fp32, [chunks, M, N])."""
    pid_m, pid_n, chunk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(chunk * CHUNK_K, tl.minimum(chunk * CHUNK_K + CHUNK_K, K), BLOCK_K):
        x, w = _load_block(x_ptr, w_ptr, rows, cols, k0, M, N, K, stride_xm, stride_xk, stride_wn, stride_wk,
                           BLOCK_K, EVEN_K, True)
        acc = _dot(x, w, acc, IEEE)
    offsets = chunk.to(tl.int64) * M * N + rows[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(partial_ptr + offsets, acc, mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _sum_chunks_kernel(partial_ptr, out_ptr, residual_ptr, total_elements, chunks, BLOCK: tl.constexpr,
                       HAS_RESIDUAL: tl.constexpr):
    """out = partial[0] + partial[1] + ... in order, as ``_matmul_kernel`` adds its chunks (and
    its residual)."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < total_elements
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for chunk in range(0, chunks):
        total += tl.load(partial_ptr + chunk.to(tl.int64) * total_elements + offsets, mask=mask, other=0.0)
    result = _plus_residual(total.to(out_ptr.dtype.element_ty), residual_ptr, offsets, mask, HAS_RESIDUAL)
    tl.store(out_ptr + offsets, result, mask=mask)


def matmul(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``x[M, K] @ weight[N, K].T`` in ``x``'s dtype, fp32 accumulation (IEEE fp32 for fp32); with
    ``residual[M, N]``, ``residual + x @ weight.T`` with eager torch's two roundings, in the
    same launch (a decode step pays for every launch).

    K is summed in chunks of ``MATMUL_CHUNK_K``, each from zero in blocks of ``MATMUL_BLOCK_K``,
    and the chunk sums are added in order, by one of three launches with the same sums: large
    tiles for large products, small tiles, or (few small tiles: small M) each chunk in a program
    of its own and a second kernel adding them.
    """
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if residual is not None:
        if residual.shape != out.shape or residual.dtype != out.dtype:
            raise ValueError(f"matmul: residual {tuple(residual.shape)} {residual.dtype} does not match the "
                             f"output {tuple(out.shape)} {out.dtype}")
        residual = residual.contiguous()
    residual_ptr, has_residual = (out, False) if residual is None else (residual, True)
    ieee = x.dtype == torch.float32
    sums = dict(BLOCK_K=MATMUL_BLOCK_K, CHUNK_K=MATMUL_CHUNK_K, EVEN_K=k % MATMUL_BLOCK_K == 0, IEEE=ieee)
    strides = (x.stride(0), x.stride(1), weight.stride(0), weight.stride(1))
    chunks = triton.cdiv(k, MATMUL_CHUNK_K)
    block_m, block_n, warps, stages = LARGE_TILE
    tiles_m, tiles_n = triton.cdiv(m, block_m), triton.cdiv(n, block_n)
    if ieee or tiles_m * tiles_n < LARGE_MIN_TILES:
        block_m, block_n, warps, stages = SMALL_TILE
        tiles_m, tiles_n = triton.cdiv(m, block_m), triton.cdiv(n, block_n)
        if chunks > 1 and tiles_m * tiles_n < SPLIT_BELOW_TILES:
            partial = torch.empty(chunks, m, n, dtype=torch.float32, device=x.device)
            _matmul_chunk_kernel[(tiles_m, tiles_n, chunks)](
                x, weight, partial, m, n, k, *strides, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
                num_stages=stages, **sums)
            _sum_chunks_kernel[(triton.cdiv(m * n, ROW_BLOCK),)](partial, out, residual_ptr, m * n, chunks,
                                                                 BLOCK=ROW_BLOCK, HAS_RESIDUAL=has_residual)
            return out
    tiles = tiles_m * tiles_n
    _matmul_kernel[(tiles,)](x, weight, out, residual_ptr, m, n, k, *strides, out.stride(0), out.stride(1),
                             BLOCK_M=block_m, BLOCK_N=block_n, GROUP_M=8, num_warps=warps, num_stages=stages,
                             HAS_RESIDUAL=has_residual, **sums)
    return out


@triton.jit
def _grouped_matmul_kernel(x_ptr, w_ptr, out_ptr, row_start_ptr, counts_ptr, tile_end_ptr, num_experts, N, K,
                           stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_om, stride_on,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           CHUNK_K: tl.constexpr, EXPERTS: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr):
    """One output tile of one expert's rows (``_tile_sum``, as ``_matmul_kernel`` sums a tile). Program
    ``(m, n)`` takes the expert whose tiles of rows (``tile_end``: each expert's last tile + 1,
    cumulative) hold tile ``m``; programs past the last tile do nothing."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    experts = tl.arange(0, EXPERTS)
    tile_ends = tl.load(tile_end_ptr + experts, mask=experts < num_experts, other=2**30)
    expert = tl.sum((tile_ends <= pid_m).to(tl.int32))
    if expert >= num_experts:
        return
    count = tl.load(counts_ptr + expert)
    first_tile = tl.load(tile_end_ptr + expert) - tl.cdiv(count, BLOCK_M)
    start = tl.load(row_start_ptr + expert)
    rows = start + (pid_m - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_limit = start + count
    total = _tile_sum(x_ptr, w_ptr + expert.to(tl.int64) * stride_we, rows, cols, row_limit, N, K, stride_xm,
                      stride_xk, stride_wn, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, CHUNK_K, EVEN_K, IEEE, True)
    offsets = rows[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_on
    tl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < row_limit) & (cols[None, :] < N))


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``x[M, K]``'s rows in groups, ``counts[e]`` rows for expert ``e`` in expert order, each
    group times ``weight[e].T`` (``weight [E, N, K]``): each row with the bits ``matmul`` gives it
    (K summed in the same chunks and blocks), in one launch whose size depends on M and E only.
    ``counts`` stays on the GPU (nothing waits for it on the host), so a CUDA graph can hold the
    launch: a grid of every tile M rows could need, ``cdiv(M, BLOCK_M) + E``, most of which exit
    at once when few experts got rows."""
    m, k = x.shape
    experts, n, _ = weight.shape
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m, block_n, warps, stages = SMALL_TILE
    counts = counts.to(torch.int32)
    row_start = counts.cumsum(0, dtype=torch.int32) - counts
    tile_end = ((counts + block_m - 1) // block_m).cumsum(0, dtype=torch.int32)
    grid = (triton.cdiv(m, block_m) + experts, triton.cdiv(n, block_n))
    _grouped_matmul_kernel[grid](
        x, weight, out, row_start, counts, tile_end, experts, n, k, x.stride(0), x.stride(1), *weight.stride(),
        out.stride(0), out.stride(1), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=MATMUL_BLOCK_K,
        CHUNK_K=MATMUL_CHUNK_K, EXPERTS=triton.next_power_of_2(experts), EVEN_K=k % MATMUL_BLOCK_K == 0,
        IEEE=x.dtype == torch.float32, num_warps=warps, num_stages=stages)
    return out


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, N, heads, stride_xt, stride_xh, stride_out, eps, BLOCK: tl.constexpr):
    """One row: ``x[t, h]`` of ``x[T, heads, N]`` (strided in T and heads), into ``out`` row ``t * heads + h``."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + (row // heads) * stride_xt + (row % heads) * stride_xh
    squares = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, N, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < N, other=0.0).to(tl.float32)
        squares += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / N + eps)
    for c0 in range(0, N, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < N, other=0.0)
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0)
        normed = (x.to(tl.float32) * rstd).to(x.dtype)
        scaled = w.to(tl.float32) * normed.to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, scaled.to(out_ptr.dtype.element_ty),
                 mask=cols < N)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Contiguous; ``x`` may be strided in its leading dims (per-head q/k: column blocks of a
    stacked q/k/v product) without a copy."""
    rows = x.reshape(-1, x.shape[-2], x.shape[-1]) if x.dim() > 2 else x.reshape(1, -1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    tokens, heads, n = rows.shape
    out = torch.empty(tokens * heads, n, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if out.shape[0]:
        _rms_norm_kernel[(out.shape[0],)](rows, weight, out, n, heads, rows.stride(0), rows.stride(1),
                                          out.stride(0), eps, BLOCK=min(ROW_BLOCK, triton.next_power_of_2(n)))
    return out.view(x.shape)


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


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, n, stride_gate, stride_up, BLOCK: tl.constexpr):
    """Columns ``[BLOCK * program_id(1), ...)`` of row ``program_id(0)``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * n + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in one kernel: silu in fp32 as ``g / (1 + exp(-g))`` rounded to the
    dtype, times ``up`` rounded again (eager torch's roundings). Contiguous; ``gate`` and ``up``
    may be strided in their rows (column blocks of a stacked gate/up product) without a copy."""
    rows_gate, rows_up = (t.reshape(-1, t.shape[-1]) for t in (gate, up))
    if rows_gate.stride(-1) != 1 or rows_up.stride(-1) != 1:
        rows_gate, rows_up = rows_gate.contiguous(), rows_up.contiguous()
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    rows, n = rows_gate.shape
    if out.numel():
        _silu_mul_kernel[(rows, triton.cdiv(n, ROW_BLOCK))](rows_gate, rows_up, out, n, rows_gate.stride(0),
                                                            rows_up.stride(0), BLOCK=ROW_BLOCK)
    return out


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, stride_xt, stride_xh, stride_ct,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """One token, every head: ``x * cos + rotate_half(x) * sin``, each product rounded to the dtype
    and the sum rounded again (eager torch's roundings)."""
    token = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < heads) & (d < HALF)
    first_at = x_ptr + token * stride_xt + h * stride_xh + d
    first = tl.load(first_at, mask=mask, other=0.0)
    second = tl.load(first_at + HALF, mask=mask, other=0.0)
    dtype = first.dtype
    cos_at, sin_at = cos_ptr + token * stride_ct + d, sin_ptr + token * stride_ct + d
    cos_first = tl.load(cos_at, mask=d < HALF, other=0.0)
    cos_second = tl.load(cos_at + HALF, mask=d < HALF, other=0.0)
    sin_first = tl.load(sin_at, mask=d < HALF, other=0.0)
    sin_second = tl.load(sin_at + HALF, mask=d < HALF, other=0.0)
    out_first = (first * cos_first).to(dtype) + (-second * sin_first).to(dtype)
    out_second = (second * cos_second).to(dtype) + (first * sin_second).to(dtype)
    out_at = out_ptr + token * heads * (2 * HALF) + h * (2 * HALF) + d
    tl.store(out_at, out_first.to(dtype), mask=mask)
    tl.store(out_at + HALF, out_second.to(dtype), mask=mask)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x[T, H, D] * cos + rotate_half(x) * sin`` (``cos``, ``sin``: ``[T, D]`` in x's dtype) in
    one kernel; contiguous ``[T, H, D]``."""
    tokens, heads, dim = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(tokens, heads, dim, dtype=x.dtype, device=x.device)
    if tokens:
        _rope_kernel[(tokens,)](x, cos, sin, out, heads, x.stride(0), x.stride(1), cos.stride(0), HALF=dim // 2,
                                BLOCK_H=triton.next_power_of_2(heads), BLOCK_HALF=triton.next_power_of_2(dim // 2))
    return out
