"""The fixed-order CPU kernels: every output element is one fixed sequence of IEEE operations on
its own inputs. What differs between CPUs (instruction set, FMA instruction or libm's fmaf) is
reproduced here by building the kernels with other compiler flags: each build must give the same
bits, so no CPU can give others."""

import pytest
import torch
import torch.nn.functional as F

from rlactors.on_policy import cpu_kernels

BUILDS = {  # the flags of each build besides the default (-O3 -march=native)
    "x86-64 baseline (SSE2, fmaf from libm)": ("-O3", "-march=x86-64", "-ffp-contract=off", "-fPIC", "-shared"),
    "AVX2 + FMA": ("-O3", "-march=haswell", "-ffp-contract=off", "-fPIC", "-shared"),
    "unoptimized": ("-O0", "-ffp-contract=off", "-fPIC", "-shared"),
}


@pytest.fixture(scope="module")
def other_builds():
    return {name: cpu_kernels.load_library(cpu_kernels.compile_library(flags)) for name, flags in BUILDS.items()}


def attention_inputs(lengths, hq=4, hkv=2, d=40, seed=0):
    """Queries of every position of segments of ``lengths``, their K/V in shuffled slots."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    kv = torch.randn(2, hkv, len(lengths) * width + 7, d, generator=gen)
    key_slots = torch.randperm(kv.shape[2], generator=gen)[:len(lengths) * width].view(len(lengths), width)
    segments = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    positions = torch.cat([torch.arange(n) for n in lengths])
    q = torch.randn(len(positions), hq, d, generator=gen)
    return q, kv, key_slots, segments, positions


def test_builds_for_other_instruction_sets_give_the_same_bits(other_builds):
    gen = torch.Generator().manual_seed(0)
    a, weight_t = torch.randn(37, 200, generator=gen), torch.randn(200, 150, generator=gen)
    inputs = attention_inputs([70, 3, 33])
    matmul, attention = cpu_kernels.matmul(a, weight_t), cpu_kernels.attend(*inputs)
    for name, library in other_builds.items():
        assert torch.equal(cpu_kernels.matmul(a, weight_t, library), matmul), name
        assert torch.equal(cpu_kernels.attend(*inputs, library=library), attention), name


@pytest.mark.parametrize("m, k, n", [(1, 1, 1), (37, 128, 256), (200, 384, 128), (5, 1000, 77)])
def test_matmul_element_depends_only_on_its_row_and_column(m, k, n):
    """Any slice of rows, and any slice of the weight's columns (a stacked q/k/v split apart),
    has the bits it has in the whole product; the values are a matmul's."""
    gen = torch.Generator().manual_seed(1)
    a, weight_t = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
    full = cpu_kernels.matmul(a, weight_t)
    torch.testing.assert_close(full, a @ weight_t, rtol=1e-4, atol=1e-4 * k**0.5)
    for start, rows in [(0, 1), (m // 2, 1), (0, min(m, 5)), (m - 1, 1), (max(m - 9, 0), min(m, 9))]:
        assert torch.equal(cpu_kernels.matmul(a[start:start + rows], weight_t), full[start:start + rows])
    for start, cols in [(0, 1), (n // 3, min(n, 17)), (max(n - 70, 0), min(n, 70))]:
        part = weight_t[:, start:start + cols].contiguous()
        assert torch.equal(cpu_kernels.matmul(a, part), full[:, start:start + cols])


def test_matmul_of_an_empty_batch():
    assert cpu_kernels.matmul(torch.randn(0, 8), torch.randn(8, 3)).shape == (0, 3)


def test_attend_is_causal_attention_and_each_query_has_the_bits_it_has_alone():
    lengths = [70, 3, 33, 1, 17]
    q, kv, key_slots, segments, positions = attention_inputs(lengths)
    out = cpu_kernels.attend(q, kv, key_slots, segments, positions)
    start = 0
    for s, n in enumerate(lengths):
        keys, values = kv[:, :, key_slots[s, :n]].repeat_interleave(2, dim=1)  # GQA: 2 query heads per kv head
        reference = F.scaled_dot_product_attention(q[start:start + n].transpose(0, 1), keys, values, is_causal=True)
        torch.testing.assert_close(out[start:start + n], reference.transpose(0, 1), atol=2e-6, rtol=1e-5)
        start += n
    for i in (0, 5, 69, 70, 72, 73, len(positions) - 1):
        alone = cpu_kernels.attend(q[i:i + 1], kv, key_slots, segments[i:i + 1], positions[i:i + 1])
        assert torch.equal(alone, out[i:i + 1]), i


def test_attend_weights_far_below_the_largest_are_clamped_not_lost():
    """A score 200 below the row's largest weighs exp(-87) instead of underflowing: finite, and
    the output is the largest key's value to fp32 precision."""
    q, kv, key_slots, segments, positions = attention_inputs([2], hq=1, hkv=1, d=1)
    q.fill_(1.0)
    kv[0, 0, key_slots[0, 0], 0], kv[0, 0, key_slots[0, 1], 0] = -200.0, 0.0
    out = cpu_kernels.attend(q, kv, key_slots, segments, positions)
    assert torch.equal(out[1], kv[1, 0, key_slots[0, 1]][None])


def test_a_missing_compiler_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(RuntimeError, match="needs a C compiler: 'no-such-compiler' was not found"):
        cpu_kernels.compile_library()


def test_attend_refuses_what_it_cannot_read():
    q, kv, key_slots, segments, positions = attention_inputs([5, 9])
    bad_slots = key_slots.clone()
    bad_slots[1, 8] = kv.shape[2]  # read by the last query only
    cases = [(key_slots.clone().fill_(-1), segments, positions), (bad_slots, segments, positions),
             (key_slots, segments + 1, positions), (key_slots, segments, positions + 1)]
    for slots, segs, pos in cases:  # a negative slot, a slot past the end, a segment, a position
        with pytest.raises(IndexError, match="out of range"):
            cpu_kernels.attend(q, kv, slots, segs, pos)
    bad_slots[1, 8] = 0  # beyond every query's position: never read
    cpu_kernels.attend(q[:13], kv, bad_slots, segments[:13], positions[:13])


def test_a_failing_build_shows_the_compiler_output(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(RuntimeError, match="(?s)compiling .*cpu_kernels.c failed:.*no-such-option"):
        cpu_kernels.compile_library(("-fno-such-option", "-fPIC", "-shared"))
    assert not list((tmp_path / "rlactors").glob("*.so"))  # nothing half-built is left to load
