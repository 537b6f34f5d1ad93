"""Batch-invariant ops: a row's value is bitwise the same alone, in any batch, at any place.

Each invariance test computes the same rows inside batches of different sizes and at different
offsets and asserts torch.equal. Where torch's default op is not invariant on this CPU, a test
measures that too, so the reason for each replacement stays visible. (Attention's batch
invariance: tests/on_policy/test_invariant_attention.py.)
"""

import pytest
import torch
import torch.nn.functional as F

from rlactors.models.checkpoint import from_pretrained
from rlactors.models.decoder import RMSNorm, apply_rope, rms_norm, rope_inverse_frequencies
from rlactors.models.moe import SparseMoeBlock
from rlactors.on_policy import ops as bi
from rlactors.on_policy.modules import (
    FrozenInvariantLinear,
    InvariantLinear,
    project,
    stack_weights,
    to_batch_invariant,
)

BATCHES = [(0, 1), (5, 1), (0, 3), (2, 7), (0, 16), (3, 37), (0, 100), (1, 199)]  # (offset, rows)


def rows_equal_in_every_batch(fn, x: torch.Tensor) -> bool:
    """fn on all rows of x == fn on every (offset, rows) slice of them, bitwise."""
    full = fn(x)
    return all(torch.equal(fn(x[o:o + n]), full[o:o + n]) for o, n in BATCHES)


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


# -- matmul ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k, n", [(128, 384), (256, 1024), (1024, 256), (3072, 512)])
def test_linear_rows_are_batch_invariant(dtype, k, n):
    w, x = torch.randn(n, k).to(dtype), torch.randn(200, k).to(dtype)
    torch.set_num_threads(2)
    full = bi.linear(x, w)
    for threads in (1, 2, 3):  # the generator and the trainer need not have the same thread count
        torch.set_num_threads(threads)
        assert all(torch.equal(bi.linear(x[o:o + n], w), full[o:o + n]) for o, n in BATCHES)


def test_project_stacks_frozen_linears_with_the_bits_of_each_alone():
    """An engine's q/k/v (and gate/up) projections in one product of stacked weights: the same
    bits as each linear alone, with or without biases, and after a weight load."""
    layers = [FrozenInvariantLinear(64, n, bias=bias) for n, bias in ((48, True), (16, True), (32, False))]
    x = torch.randn(7, 3, 64)
    with torch.inference_mode():
        alone = [bi.linear(x, m.weight, m.bias) for m in layers]
        fused = project(x, layers)
        assert all(torch.equal(a, f) and f.is_contiguous() for a, f in zip(alone, fused))
    with torch.no_grad():
        layers[1].weight.copy_(torch.randn(16, 64))  # a weight load
    with torch.inference_mode():
        assert torch.equal(project(x, layers)[1], bi.linear(x, layers[1].weight, layers[1].bias))


def test_project_in_training_has_the_bits_of_each_linear_and_the_default_gradients():
    """A trainer's q/k/v in one product: forward the bits of each linear alone, backward the
    gradients of separate default linears (x's summed over the three)."""
    layers = [InvariantLinear(64, n, bias=bias) for n, bias in ((48, True), (16, True), (32, False))]
    x = torch.randn(7, 3, 64, requires_grad=True)
    fused = project(x, layers)
    with torch.no_grad():
        assert all(torch.equal(bi.linear(x, m.weight, m.bias), f) for m, f in zip(layers, fused))
    upstream = [torch.randn_like(f) for f in fused]
    torch.autograd.backward(fused, upstream)
    mine = [x.grad] + [m.weight.grad for m in layers] + [m.bias.grad for m in layers[:2]]
    x.grad = None
    for m in layers:
        m.zero_grad()
    torch.autograd.backward([F.linear(x, m.weight, m.bias) for m in layers], upstream)
    reference = [x.grad] + [m.weight.grad for m in layers] + [m.bias.grad for m in layers[:2]]
    for a, b in zip(mine, reference):
        torch.testing.assert_close(a, b)


def test_project_rejects_an_input_that_does_not_match_the_weights():
    layers = [InvariantLinear(64, 16, bias=False), InvariantLinear(64, 8, bias=False)]
    with pytest.raises(ValueError, match="project: x"):
        project(torch.randn(3, 32), layers)


def test_frozen_weights_are_transposed_once_per_version():
    """An engine's linears keep the weight's transpose until an in-place load changes the weight."""
    layer = FrozenInvariantLinear(64, 32, bias=False)
    x = torch.randn(5, 64)
    with torch.no_grad():
        first = layer(x)
        kept = layer._transposed[2]
        assert torch.equal(layer(x), first) and layer._transposed[2] is kept
        layer.weight.copy_(torch.randn(32, 64))  # a weight load
        assert torch.equal(layer(x), bi.linear(x, layer.weight)) and not torch.equal(layer(x), first)
    with torch.inference_mode():  # the engine steps in inference mode
        assert torch.equal(layer(x), bi.linear(x, layer.weight))


def test_linear_matches_default_and_keeps_leading_dims():
    w, x = torch.randn(96, 64), torch.randn(3, 5, 64)
    out = bi.linear(x, w)
    assert out.shape == (3, 5, 96)
    torch.testing.assert_close(out, F.linear(x, w))
    assert torch.equal(bi.linear(x, w)[1], bi.linear(x[1], w))


def test_linear_gradients_are_the_default_ones():
    w, x = torch.randn(48, 32, requires_grad=True), torch.randn(21, 32, requires_grad=True)
    grad = torch.randn(21, 48)
    bi.linear(x, w).backward(grad)
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    F.linear(x, w).backward(grad)
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, w.grad)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_bias_is_added_after_the_batch_invariant_matmul(dtype, device):
    """Qwen2's q/k/v biases: an elementwise add, so rows stay batch-invariant; gradients are the
    default ones, and the module adds its bias on every path."""
    gen = torch.Generator().manual_seed(0)
    w, b, x = (torch.randn(*shape, generator=gen).to(device, dtype) for shape in ((96, 256), (96,), (200, 256)))
    full = bi.linear(x, w, b)
    assert torch.equal(full, bi.linear(x, w) + b)
    assert all(torch.equal(bi.linear(x[o:o + n], w, b), full[o:o + n]) for o, n in BATCHES)
    # Another summation order than the BLAS's; bf16 also rounds the sum before the bias.
    tolerance = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 1e-1}
    torch.testing.assert_close(full, F.linear(x, w, b), **tolerance)

    w, b, x = (t.float().requires_grad_() for t in (w, b, x[:21]))
    grad = torch.randn(21, 96, generator=gen).to(device)
    bi.linear(x, w, b).backward(grad)
    ours = [t.grad.clone() for t in (x, w, b)]
    x.grad = w.grad = b.grad = None
    F.linear(x, w, b).backward(grad)
    for got, expected in zip(ours, (x.grad, w.grad, b.grad)):
        torch.testing.assert_close(got, expected)

    layer = InvariantLinear(256, 96, bias=True).to(device)
    x = torch.randn(5, 256, generator=gen).to(device)
    with torch.no_grad():
        assert torch.equal(layer(x), bi.linear(x, layer.weight, layer.bias))
        frozen = FrozenInvariantLinear(256, 96, bias=True).to(device)
        frozen.load_state_dict(layer.state_dict())
        assert torch.equal(frozen(x), bi.linear(x, layer.weight, layer.bias))
    with pytest.raises(ValueError, match="bias"):
        bi.linear(x, layer.weight, layer.bias[:-1])


def test_linear_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="does not match"):
        bi.linear(torch.randn(4, 8), torch.randn(16, 9))
    with pytest.raises(ValueError, match="bfloat16"):
        bi.linear(torch.randn(4, 8), torch.randn(16, 8, dtype=torch.bfloat16))


# -- elementwise and row-wise ops ------------------------------------------------------------------


def test_default_silu_depends_on_position_in_tensor():
    """torch computes the tail of the vectorized loop with the scalar sigmoid, which rounds
    differently: the same element, sliced at another offset, can change."""
    x = torch.randn(4096) * 3
    full = F.silu(x)
    assert any(not torch.equal(F.silu(x[o:o + n]), full[o:o + n]) for n in range(30, 70) for o in range(17))


def test_silu_mul_is_position_invariant_and_close_to_silu():
    gate, up = torch.randn(4096) * 3, torch.randn(4096)
    full = bi.silu_mul(gate, up)
    assert all(torch.equal(bi.silu_mul(gate[o:o + n], up[o:o + n]), full[o:o + n])
               for n in range(30, 70) for o in range(17))
    torch.testing.assert_close(full, F.silu(gate) * up)
    half = bi.silu_mul(gate.bfloat16(), up.bfloat16())
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), F.silu(gate.bfloat16()).float() * up.bfloat16().float(),
                               atol=1e-2, rtol=1e-2)


def test_silu_mul_gradients_are_silus():
    gate, up = (torch.randn(64, 96, requires_grad=True) for _ in range(2))
    grad = torch.randn(64, 96)
    bi.silu_mul(gate, up).backward(grad)
    mine = gate.grad.clone(), up.grad.clone()
    gate.grad = up.grad = None
    (F.silu(gate) * up).backward(grad)
    torch.testing.assert_close(mine[0], gate.grad)
    torch.testing.assert_close(mine[1], up.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_the_models_and_row_invariant(dtype):
    norm = RMSNorm(128, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(200, 128).to(dtype)
    with torch.no_grad():
        assert torch.equal(bi.rms_norm(x, norm.weight, norm.eps), norm(x))
        assert rows_equal_in_every_batch(lambda t: bi.rms_norm(t, norm.weight, norm.eps), x)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_rms_norm_gradients_are_the_default_ones(device):
    gen = torch.Generator().manual_seed(0)
    x, weight, grad = (torch.randn(*shape, generator=gen).to(device) for shape in ((50, 128), (128,), (50, 128)))
    x.requires_grad_(), weight.requires_grad_()
    bi.rms_norm(x, weight, 1e-6).backward(grad)
    ours = x.grad.clone(), weight.grad.clone()
    x.grad = weight.grad = None
    rms_norm(x, weight, 1e-6).backward(grad)
    assert weight.grad.abs().max() > 0
    torch.testing.assert_close(ours[0], x.grad)
    torch.testing.assert_close(ours[1], weight.grad)


def test_closed_form_backwards_are_the_autograd_gradients_of_the_default_ops():
    """The written-out gradients the true on-policy trainer runs (compiled on CUDA) against autograd
    through the default ops, in fp32."""
    gen = torch.Generator().manual_seed(0)
    x, grad = torch.randn(3, 50, 128, generator=gen), torch.randn(3, 50, 128, generator=gen)
    weight = torch.randn(128, generator=gen)
    expected = torch.autograd.grad(rms_norm(x.requires_grad_(), weight.requires_grad_(), 1e-6),
                                   (x, weight), grad)
    for mine, theirs in zip(bi.rms_norm_backward(x.detach(), weight.detach(), grad, 1e-6), expected):
        torch.testing.assert_close(mine, theirs)
    gate, up = (torch.randn(50, 96, generator=gen, requires_grad=True) for _ in range(2))
    grad = torch.randn(50, 96, generator=gen)
    expected = torch.autograd.grad(F.silu(gate) * up, (gate, up), grad)
    for mine, theirs in zip(bi.silu_mul_backward(gate.detach(), up.detach(), grad), expected):
        torch.testing.assert_close(mine, theirs)
    q, grad = torch.randn(50, 4, 64, generator=gen, requires_grad=True), torch.randn(50, 4, 64, generator=gen)
    angles = torch.randn(50, 32, generator=gen).repeat(1, 2)
    cos, sin = angles.cos(), angles.sin()
    (expected,) = torch.autograd.grad(apply_rope(q, cos, sin), q, grad)
    torch.testing.assert_close(bi.rope_backward(grad, cos, sin), expected)


@pytest.mark.parametrize("vocab", [1024, 151936])
def test_log_softmax_rows_are_invariant(vocab):
    logits = torch.randn(120, vocab)
    out = bi.log_softmax(logits)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, logits.log_softmax(-1))
    assert all(torch.equal(bi.log_softmax(logits[o:o + n]), out[o:o + n]) for o, n in BATCHES[:6])


def test_embedding_and_rope_are_row_invariant():
    table = torch.randn(1024, 64)
    ids = torch.randint(0, 1024, (200,))
    assert rows_equal_in_every_batch(lambda t: F.embedding(t, table), ids)
    inv_freq = rope_inverse_frequencies(32, 1e6)
    positions = torch.randint(0, 4000, (200,))
    x = torch.randn(200, 4, 32)

    def rope(rows):
        freqs = positions[rows].float()[:, None] * inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return apply_rope(x[rows], angles.cos(), angles.sin())

    assert rows_equal_in_every_batch(rope, torch.arange(200))


def test_linears_refuse_inputs_of_another_dtype_than_their_weight():
    x, weight = torch.randn(4, 8), torch.randn(3, 8).bfloat16()
    with pytest.raises(ValueError, match=r"linear: x is torch.float32 but weight is torch.bfloat16"):
        bi.linear(x, weight)
    with pytest.raises(ValueError, match=r"grouped_linear: x is torch.float32 but weight is torch.bfloat16"):
        bi.grouped_linear(x, weight[None], torch.tensor([4]))


def test_grouped_linear_backward_is_torchs_grouped_mm_backward():
    """The trainer's grouped launch on CUDA differentiates as the default mode's experts do: the
    gradients torch's autograd gives ``torch._grouped_mm``, bit for bit (here on CPU, bf16, with
    experts that got no rows)."""
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([0, 3, 0, 17, 5, 0, 8, 2])
    x = torch.randn(int(counts.sum()), 64, generator=g).bfloat16().requires_grad_()
    weight = torch.randn(8, 32, 64, generator=g).bfloat16().requires_grad_()
    grad = torch.randn(int(counts.sum()), 32, generator=g).bfloat16()
    out = torch._grouped_mm(x, weight.transpose(-2, -1), offs=counts.cumsum(0, dtype=torch.int32))
    expected = torch.autograd.grad(out, (x, weight), grad)
    ours = bi.grouped_linear_backward(x.detach(), weight.detach(), counts, grad)
    assert all(torch.equal(a, b) for a, b in zip(ours, expected))
    assert bi.grouped_linear_backward(x, weight, counts, grad, needs_x=False)[0] is None


# -- CUDA (Triton kernels) -------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
def test_default_cuda_matmul_rows_depend_on_batch_size():
    """cuBLAS picks kernels (split-K among them) by shape: a row's bits change with M."""
    w, x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16), torch.randn(512, 4096, device="cuda",
                                                                                   dtype=torch.bfloat16)
    full = F.linear(x, w)
    assert any(not torch.equal(F.linear(x[:m], w), full[:m]) for m in (1, 2, 3, 8, 16, 64, 128))


@pytest.mark.gpu
@cuda
def test_cuda_matmul_launches_give_a_row_the_same_bits():
    """The batch-invariant matmul's three launches, picked by size: large tiles (4096 rows here),
    small tiles (1200), and each chunk of K in a program of its own (1 and 300 rows)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(1024, 2048, device="cuda", generator=g).bfloat16()
    x = torch.randn(4096, 2048, device="cuda", generator=g).bfloat16()
    full = bi.linear(x, w)
    for rows in (1, 300, 1200):
        assert torch.equal(bi.linear(x[-rows:], w), full[-rows:]), rows
    torch.testing.assert_close(full.float(), F.linear(x, w).float(), atol=3e-1, rtol=2e-2)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_grouped_matmul_gives_each_row_the_bits_of_its_experts_matmul(dtype):
    """All experts in one launch, their token counts read on the GPU: each row has the bits of
    the batch-invariant matmul of its expert's rows, whatever the other experts got (none, one
    row, hundreds), and experts without rows write nothing."""
    g = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(8, 768, 2048, device="cuda", generator=g).to(dtype)
    for counts in ([0, 1, 0, 300, 5, 0, 64, 2], [1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 1100, 0, 0, 0, 0]):
        x = torch.randn(sum(counts), 2048, device="cuda", generator=g).to(dtype)
        grouped = bi.grouped_linear(x, weight, torch.tensor(counts, device="cuda"))
        each = [bi.linear(rows, weight[e]) for e, rows in enumerate(x.split(counts)) if len(rows)]
        assert torch.equal(grouped, torch.cat(each)), counts


@pytest.mark.gpu
@cuda
def test_cuda_grouped_linear_trains_as_a_linear_per_expert():
    """The trainer's grouped launch: forward bits of a batch-invariant linear per expert, and
    gradients of the default grouped GEMMs, close to those of a linear per expert."""
    g = torch.Generator(device="cuda").manual_seed(0)
    counts = [0, 3, 0, 300, 5, 0, 64, 2]
    weight = torch.randn(8, 768, 2048, device="cuda", generator=g).bfloat16().requires_grad_()
    x = torch.randn(sum(counts), 2048, device="cuda", generator=g).bfloat16().requires_grad_()
    grad = torch.randn(sum(counts), 768, device="cuda", generator=g).bfloat16()
    grouped = bi.grouped_linear(x, weight, torch.tensor(counts, device="cuda"))
    grads = torch.autograd.grad(grouped, (x, weight), grad)
    each = torch.cat([bi.linear(rows, weight[e]) for e, rows in enumerate(x.split(counts)) if len(rows)])
    assert torch.equal(grouped, each)
    for ours, theirs in zip(grads, torch.autograd.grad(each, (x, weight), grad)):
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@cuda
def test_a_cuda_graph_holds_an_engines_moe_layer_with_the_trainers_bits(family_ckpt):
    """An engine's MoE layer (router, top-k, one grouped launch per projection, the weighted sum)
    never waits for the host, so a CUDA graph captures it; replayed on new input it has the bits
    of the trainer's forward of the same layer (with autograd)."""
    engine, trainer = (from_pretrained(family_ckpt("qwen3_moe")).cuda().bfloat16() for _ in range(2))
    to_batch_invariant(engine, weights_frozen=True)
    to_batch_invariant(trainer)
    engine_block, trainer_block = (next(m for m in model.modules() if isinstance(m, SparseMoeBlock))
                                   for model in (engine, trainer))
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = engine.args.hidden_size
    x, residual = (torch.randn(64, hidden, device="cuda", generator=g).bfloat16() for _ in range(2))
    with torch.inference_mode():
        engine_block(x, residual)  # compiles the kernels outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = engine_block(x, residual)
    for _ in range(2):
        new_x = torch.randn(64, hidden, device="cuda", generator=g).bfloat16()
        x.copy_(new_x)
        graph.replay()
        trained = trainer_block(new_x.requires_grad_(), residual)
        assert torch.equal(captured, trained.detach())


@pytest.mark.gpu
@cuda
def test_cuda_engine_fusions_have_the_bits_of_the_separate_ops():
    """An engine's q/k/v and gate/up (``stack_weights``): one matmul whose column blocks are
    bitwise each linear's own product, at decode and prefill sizes and after a weight load; the
    per-head RMSNorm and silu*up read those blocks in place with the bits of contiguous copies;
    a residual added in the matmul's launch has the bits of the separate addition."""
    g = torch.Generator(device="cuda").manual_seed(0)
    layers = [FrozenInvariantLinear(1024, n, bias=False).cuda().bfloat16() for n in (2048, 1024, 1024)]
    stack_weights(layers)
    x = torch.randn(4096, 1024, device="cuda", generator=g).bfloat16()
    with torch.inference_mode():
        for rows in (1, 64, 300, 4096):
            q, k, v = project(x[:rows], layers)
            for part, layer in zip((q, k, v), layers):
                assert torch.equal(part, bi.linear(x[:rows], layer.weight)), rows
        layers[1].weight.copy_(torch.randn(1024, 1024, device="cuda", generator=g).bfloat16())  # a weight load
        q, k, v = project(x[:64], layers)
        assert torch.equal(k, bi.linear(x[:64], layers[1].weight))
        norm_w = torch.randn(128, device="cuda", generator=g).bfloat16()
        heads = q.view(64, 16, 128)
        assert not heads.is_contiguous()
        assert torch.equal(bi.rms_norm(heads, norm_w, 1e-6), bi.rms_norm(heads.contiguous(), norm_w, 1e-6))
        assert torch.equal(bi.silu_mul(q[:, :1024], q[:, 1024:]),
                           bi.silu_mul(q[:, :1024].contiguous(), q[:, 1024:].contiguous()))
        residual = torch.randn(4096, 2048, device="cuda", generator=g).bfloat16()
        for rows in (1, 64, 300, 4096):  # split K, small and large tiles
            fused = layers[0](x[:rows], residual[:rows])  # frozen: the residual in the matmul's launch
            assert torch.equal(fused, residual[:rows] + bi.linear(x[:rows], layers[0].weight)), rows


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_ops_are_batch_invariant_and_close_to_default(dtype):
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}
    w, x = (torch.randn(shape, device="cuda").to(dtype) for shape in ((1000, 2048), (300, 2048)))
    assert rows_equal_in_every_batch(lambda t: bi.linear(t, w), x)
    torch.testing.assert_close(bi.linear(x, w).float(), F.linear(x, w).float(), atol=tol["atol"] * 10,
                               rtol=tol["rtol"])
    norm_w = torch.randn(2048, device="cuda").to(dtype)
    assert rows_equal_in_every_batch(lambda t: bi.rms_norm(t, norm_w, 1e-6), x)
    x32 = x.float()
    expected = norm_w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    torch.testing.assert_close(bi.rms_norm(x, norm_w, 1e-6), expected)
    gate, up = x[:, :1024], x[:, 1024:]
    assert rows_equal_in_every_batch(lambda t: bi.silu_mul(t[:, :1024], t[:, 1024:]), x)
    torch.testing.assert_close(bi.silu_mul(gate, up).float(), (F.silu(gate.float()) * up.float()), **tol)
    heads = x.view(300, 16, 128)
    angles = torch.randn(1, 64, device="cuda").repeat(300, 2)  # every token at one position: any slice fits
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    assert rows_equal_in_every_batch(lambda t: bi.rope(t, cos[:len(t)], sin[:len(t)]), heads)
    torch.testing.assert_close(bi.rope(heads, cos, sin), apply_rope(heads, cos, sin), **tol)
    logits = torch.randn(300, 151936, device="cuda")
    assert rows_equal_in_every_batch(bi.log_softmax, logits)
    torch.testing.assert_close(bi.log_softmax(logits), logits.log_softmax(-1))
