"""Batch-invariant attention (rlactors.on_policy.attention): a query's output is bitwise the same
for the whole sequence, one decode step at a time, in prefill chunks, among other sequences, and
however documents are packed; keys read in place from paged slots give the same bits. Where torch's
default attention is not invariant, a test measures that too.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from rlactors.attention.varlen import VarlenAttention
from rlactors.on_policy import attention as attn


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


def causal_reference(q, k, v):
    """[L, Hq, D] causal SDPA of one sequence (GQA)."""
    return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          is_causal=True, enable_gqa=True).transpose(0, 1)


def one_segment(n):
    return torch.zeros(n, dtype=torch.long)


def head_major(x):
    """[S, L, Hkv, D] -> the [S, Hkv, L, D] view attend reads (a paged cache's layout)."""
    return x.transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_same_bits_for_whole_sequence_decode_chunks_and_batches(dtype):
    length, hq, hkv, d = 150, 4, 2, 32
    q, k, v = (torch.randn(length, h, d).to(dtype) for h in (hq, hkv, hkv))
    positions = torch.arange(length)
    whole = attn.attend(q, positions, one_segment(length), head_major(k[None]), head_major(v[None]))
    torch.testing.assert_close(whole.float(), causal_reference(q.float(), k.float(), v.float()),
                               atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=1e-3)

    # A KV cache longer than the sequence, NaN past its end (never-written or stale slots).
    cache_k = torch.full((1, 300, hkv, d), float("nan"), dtype=dtype)
    cache_v = cache_k.clone()
    cache_k[0, :length], cache_v[0, :length] = k, v
    cache_k, cache_v = head_major(cache_k), head_major(cache_v)
    decode = torch.cat([attn.attend(q[p:p + 1], positions[p:p + 1], one_segment(1), cache_k, cache_v)
                        for p in range(length)])
    assert torch.equal(decode, whole)
    for chunk in (7, 37, 64):
        chunks = torch.cat([attn.attend(q[s:s + chunk], positions[s:s + chunk],
                                        one_segment(len(positions[s:s + chunk])),
                                      cache_k, cache_v) for s in range(0, length, chunk)])
        assert torch.equal(chunks, whole)

    # The same query among 16 others of other sequences, lengths and phases (decode and prefill).
    keys, values = torch.randn(17, 300, hkv, d).to(dtype), torch.randn(17, 300, hkv, d).to(dtype)
    keys[9, :length], values[9, :length] = k, v
    keys, values = head_major(keys), head_major(values)
    segments, pos = [], []
    for s in range(17):
        n = 1 if s % 2 else 1 + 3 * s
        first = 120 + s if s % 2 else 0
        segments += [s] * n
        pos += range(first, first + n)
    mine = segments.index(9)
    segments[mine:mine + 1], pos[mine:mine + 1] = [9, 9], [99, 100]
    batch_q = torch.randn(len(pos), hq, d).to(dtype)
    batch_q[mine:mine + 2] = q[99:101]
    out = attn.attend(batch_q, torch.tensor(pos), torch.tensor(segments), keys, values)
    assert torch.equal(out[mine:mine + 2], whole[99:101])


def test_long_documents_same_bits_for_every_query_alone():
    length, hq, hkv, d = 1100, 4, 2, 16
    q, k, v = torch.randn(length, hq, d), torch.randn(1, hkv, length, d), torch.randn(1, hkv, length, d)
    whole = attn.AttentionPlan(torch.arange(length), one_segment(length))(q, k, v)
    torch.testing.assert_close(whole, causal_reference(q, head_major(k)[0], head_major(v)[0]), atol=1e-5, rtol=1e-3)
    for position in (0, 15, 16, 17, 63, 64, 1099):  # decode queries, at and around the kernel's lanes
        alone = attn.AttentionPlan(torch.tensor([position]), one_segment(1))(q[position:position + 1], k, v)
        assert torch.equal(alone, whole[position:position + 1]), position


def test_paged_attend_same_bits_as_whole_keys_in_any_query_order():
    """plan.paged (keys read in place from slots of a shared buffer: the engine's and the
    trainer's CPU path) == plan(q, keys, values), for decodes in the engine's order, the same
    decodes reversed, and a step with prefill chunks; slots no query may read hold NaN."""
    hq, hkv, d, length = 4, 2, 32, 200
    lengths = [30, 64, 65, 130, 199, 7]
    keys, values = torch.randn(len(lengths), hkv, length, d), torch.randn(len(lengths), hkv, length, d)
    kv = torch.full((2, hkv, 1600, d), float("nan"))
    key_slots = torch.randperm(1600)[:len(lengths) * length].view(len(lengths), length)
    for s, n in enumerate(lengths):  # segment s's keys 0 .. n-1 in its slots; the rest stay NaN
        slots = key_slots[s, :n]
        kv[0, :, slots], kv[1, :, slots] = keys[s, :, :n], values[s, :, :n]

    decodes = (torch.tensor([n - 1 for n in lengths]), torch.arange(len(lengths)))
    order = torch.argsort(decodes[0])  # by length, as the engine packs decodes
    steps = {"decodes in order": (decodes[0][order], decodes[1][order]),
             "decodes reversed": (decodes[0][order.flip(0)], decodes[1][order.flip(0)]),
             "decodes and prefill chunks": (torch.cat([decodes[0][:3], torch.arange(60, 130), torch.arange(7)]),
                                            torch.cat([decodes[1][:3], torch.full((70,), 3), torch.full((7,), 5)]))}
    for name, (positions, segments) in steps.items():
        q = torch.randn(len(positions), hq, d)
        plan = attn.AttentionPlan(positions, segments)
        paged = plan.paged(q, kv, key_slots)
        assert not paged.isnan().any(), name
        assert torch.equal(paged, attn.AttentionPlan(positions, segments)(q, keys, values)), name


def test_packed_attention_same_bits_as_attend_over_padded_documents():
    lengths = [40, 7, 90, 1, 33]
    positions, q, k, v = packed_documents(lengths)
    packed = attn.BatchInvariantAttention.from_positions(positions)(0, q, k, v)
    keys, values = torch.zeros(2, len(lengths), max(lengths), 2, 32)
    start = 0
    for i, n in enumerate(lengths):
        keys[i, :n], values[i, :n] = k[start:start + n], v[start:start + n]
        start += n
    segments = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    assert torch.equal(packed, attn.attend(q, positions, segments, head_major(keys), head_major(values)))


def test_default_sdpa_decode_differs_from_whole_sequence():
    """The default way (one query against its prefix vs the causal whole) rounds differently."""
    length, d = 150, 32
    q, k, v = torch.randn(length, 4, d), torch.randn(length, 2, d), torch.randn(length, 2, d)
    whole = causal_reference(q, k, v)
    decode = torch.cat([F.scaled_dot_product_attention(
        q[p:p + 1].transpose(0, 1), k[:p + 1].transpose(0, 1), v[:p + 1].transpose(0, 1), enable_gqa=True
    ).transpose(0, 1) for p in range(length)])
    torch.testing.assert_close(decode, whole)
    assert not torch.equal(decode, whole)


def test_attend_rejects_bad_inputs():
    q, keys = torch.randn(3, 4, 8), torch.randn(2, 2, 10, 8)
    with pytest.raises(ValueError, match=">= 0"):
        attn.attend(q, torch.tensor([0, -1, 2]), one_segment(3), keys, keys)
    with pytest.raises(ValueError, match="do not reach"):
        attn.attend(q, torch.tensor([0, 1, 10]), one_segment(3), keys, keys)
    with pytest.raises(ValueError, match="do not reach"):
        attn.attend(q, torch.tensor([0, 1, 2]), torch.tensor([0, 0, 2]), keys, keys)
    with pytest.raises(ValueError, match="multiple of the kv heads"):
        attn.attend(torch.randn(3, 3, 8), torch.arange(3), one_segment(3), keys, keys)
    with pytest.raises(ValueError, match="1-D of equal length"):
        attn.attend(q, torch.arange(3), one_segment(2), keys, keys)


def packed_documents(lengths, hq=4, hkv=2, d=32):
    positions = torch.cat([torch.arange(n) for n in lengths])
    t = positions.numel()
    return positions, torch.randn(t, hq, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)


def test_packed_attention_same_bits_however_documents_are_packed():
    lengths = [40, 7, 90, 1, 33]
    positions, q, k, v = packed_documents(lengths)
    packed = attn.BatchInvariantAttention.from_positions(positions)(0, q, k, v)
    torch.testing.assert_close(packed, VarlenAttention.from_positions(positions, "sdpa")(0, q, k, v))
    start = 0
    for n in lengths:  # each document alone, and in another packing order
        doc = slice(start, start + n)
        alone = attn.BatchInvariantAttention.from_positions(positions[doc])(0, q[doc], k[doc], v[doc])
        assert torch.equal(alone, packed[doc])
        start += n
    order = [2, 0, 4, 1, 3]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    idx = torch.cat([torch.arange(starts[i], starts[i] + lengths[i]) for i in order])
    repacked = attn.BatchInvariantAttention.from_positions(positions[idx])(0, q[idx], k[idx], v[idx])
    assert torch.equal(repacked, packed[idx])


def test_packed_attention_gradients_are_the_default_ones():
    positions, q, k, v = packed_documents([20, 35])
    grad = torch.randn_like(q)
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    attn.BatchInvariantAttention.from_positions(positions)(0, *inputs).backward(grad)
    reference = [t.clone().requires_grad_() for t in (q, k, v)]
    VarlenAttention.from_positions(positions)(0, *reference).backward(grad)
    for mine, ref in zip(inputs, reference):
        torch.testing.assert_close(mine.grad, ref.grad)


def test_packed_attention_rejects_wrong_token_count():
    positions, q, k, v = packed_documents([5, 6])
    with pytest.raises(ValueError, match="11 packed tokens"):
        attn.BatchInvariantAttention.from_positions(positions)(0, q[:10], k[:10], v[:10])


def test_attend_scale_is_inverse_sqrt_head_dim():
    q, k, v = torch.randn(2, 1, 16), torch.randn(2, 1, 16), torch.randn(2, 1, 16)
    out = attn.attend(q, torch.arange(2), one_segment(2), head_major(k[None]), head_major(v[None]))
    w = torch.softmax((q[1, 0] @ k[:, 0].T) / math.sqrt(16), -1)
    torch.testing.assert_close(out[1, 0], w @ v[:, 0])


# -- CUDA (Triton kernels) -------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_attend_same_bits_for_whole_sequence_decode_and_batches(dtype):
    length, hq, hkv, d = 300, 16, 8, 128
    q, k, v = (torch.randn(length, h, d, device="cuda").to(dtype) for h in (hq, hkv, hkv))
    positions, seg = torch.arange(length, device="cuda"), torch.zeros(length, dtype=torch.long, device="cuda")
    whole = attn.attend(q, positions, seg, head_major(k[None]), head_major(v[None]))
    torch.testing.assert_close(whole.float(), causal_reference(q, k, v).float(),
                               atol=1e-4 if dtype == torch.float32 else 2e-2, rtol=1e-3)
    cache_k = torch.full((3, 512, hkv, d), float("nan"), device="cuda", dtype=dtype)
    cache_v = cache_k.clone()
    cache_k[1, :length], cache_v[1, :length] = k, v
    cache_k, cache_v = head_major(cache_k), head_major(cache_v)
    ones = torch.ones(1, dtype=torch.long, device="cuda")
    for p in (0, 1, 63, 64, 65, 199, 299):
        assert torch.equal(attn.attend(q[p:p + 1], positions[p:p + 1], ones, cache_k, cache_v), whole[p:p + 1])
    chunks = torch.cat([attn.attend(q[s:s + 50], positions[s:s + 50], seg[s:s + 50] + 1, cache_k, cache_v)
                        for s in range(0, length, 50)])
    assert torch.equal(chunks, whole)


@pytest.mark.gpu
@cuda
def test_cuda_packed_attention_matches_per_document_and_default_gradients():
    positions, q, k, v = packed_documents([100, 3, 257, 64], hq=8, hkv=2, d=64)
    positions, (q, k, v) = positions.cuda(), (t.cuda().bfloat16() for t in (q, k, v))
    attention = attn.BatchInvariantAttention.from_positions(positions)
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    packed = attention(0, *inputs)
    alone = attn.BatchInvariantAttention.from_positions(positions[103:360])(0, q[103:360], k[103:360], v[103:360])
    assert torch.equal(alone, packed[103:360])
    grad = torch.randn_like(q)
    packed.backward(grad)
    reference = [t.clone().requires_grad_() for t in (q, k, v)]
    VarlenAttention.from_positions(positions)(0, *reference).backward(grad)
    for mine, ref in zip(inputs, reference):
        torch.testing.assert_close(mine.grad, ref.grad)
