"""The Triton kernel behind ``rlactors.on_policy.attention.attend`` on CUDA: one program per (query
tile, kv head), keys in blocks of ``KEY_BLOCK`` from position 0, folded in order."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlactors.on_policy.attention import KEY_BLOCK, QUERY_TILE, AttentionPlan


@triton.jit
def _attend_kernel(q_ptr, k_ptr, v_ptr, out_ptr, query_index_ptr, positions_ptr, segment_ptr, last_ptr,
                   stride_qn, stride_qh, stride_ks, stride_kl, stride_kh, stride_vs, stride_vl, stride_vh,
                   stride_on, stride_oh, scale, num_kv_heads,
                   GROUP: tl.constexpr, TILE: tl.constexpr, ROWS: tl.constexpr,
                   HEAD_DIM: tl.constexpr, KEY_BLOCK: tl.constexpr, IEEE: tl.constexpr):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    # Row r of this program: query slot r // GROUP, query head kv_head * GROUP + r % GROUP.
    r = tl.arange(0, ROWS)
    slot = r // GROUP
    row_ok = slot < TILE
    query = tl.load(query_index_ptr + tile * TILE + slot, mask=row_ok, other=-1)
    row_ok = row_ok & (query >= 0)
    position = tl.load(positions_ptr + tile * TILE + slot, mask=row_ok, other=0)
    head = kv_head * GROUP + r % GROUP
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + query[:, None].to(tl.int64) * stride_qn + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    segment = tl.load(segment_ptr + tile).to(tl.int64)
    last = tl.load(last_ptr + tile)

    running_max = tl.full((ROWS,), float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros((ROWS,), dtype=tl.float32)
    acc = tl.zeros((ROWS, HEAD_DIM), dtype=tl.float32)
    for start in range(0, last + 1, KEY_BLOCK):
        keys_at = start + tl.arange(0, KEY_BLOCK)
        seen = keys_at <= last  # past the tile's last query: masked for every row, zeroed
        k = tl.load(k_ptr + segment * stride_ks + keys_at[:, None].to(tl.int64) * stride_kl
                    + kv_head * stride_kh + d[None, :], mask=seen[:, None], other=0.0)
        v = tl.load(v_ptr + segment * stride_vs + keys_at[:, None].to(tl.int64) * stride_vl
                    + kv_head * stride_vh + d[None, :], mask=seen[:, None], other=0.0)
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            scores = tl.dot(q, tl.trans(k)) * scale
        scores = tl.where(keys_at[None, :] <= position[:, None], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        rescale = tl.exp(running_max - new_max)
        weights = tl.exp(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(weights, axis=1)
        if IEEE:
            acc = acc * rescale[:, None] + tl.dot(weights, v, input_precision="ieee")
        else:
            acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v)
        running_max = new_max
    out = acc / running_sum[:, None]
    tl.store(out_ptr + query[:, None].to(tl.int64) * stride_on + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def attend(plan: AttentionPlan, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``AttentionPlan.__call__`` on CUDA: one program per (query tile, kv head)."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    group = num_heads // num_kv_heads
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"attend on CUDA needs a power-of-two head_dim >= 16, got {head_dim}")
    q, keys, values = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, keys, values))
    out = torch.empty_like(q)
    query_index = plan.query_index
    assert plan.tile_size == QUERY_TILE
    rows = max(16, triton.next_power_of_2(QUERY_TILE * group))
    grid = (plan.num_tiles, num_kv_heads)
    _attend_kernel[grid](q, keys, values, out, query_index, plan.positions, plan.segment, plan.last,
                         q.stride(0), q.stride(1), keys.stride(0), keys.stride(2), keys.stride(1),
                         values.stride(0), values.stride(2), values.stride(1), out.stride(0), out.stride(1),
                         head_dim ** -0.5, num_kv_heads, GROUP=group, TILE=QUERY_TILE, ROWS=rows,
                         HEAD_DIM=head_dim, KEY_BLOCK=KEY_BLOCK, IEEE=q.dtype == torch.float32)
    return out
