"""Batch-invariant ops: the kernels of the true on-policy mode.

An op is *batch-invariant* when the value it computes for one row (one token) is bitwise the
same whatever else is computed in the same call. When every op of the model is, a token's
logprob is the same number in the generator and in the trainer, and the update is on-policy.

The ops: ``cpu_kernels.matmul`` on CPU (one fmaf chain per output element) and a fixed-tile
Triton matmul on CUDA; ``silu_mul`` spelled with exp and a division; one attention function for
both sides (``rlactors.on_policy.attention``); one-program-per-row Triton row reductions on CUDA.
Backward passes use the default kernels: only forward values must match the generator. Why each
default op breaks invariance and how each fix holds it: docs/ARCHITECTURE.md, "True on-policy".
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from rlactors.models import decoder
from rlactors.on_policy import cpu_kernels

# ------------------------------------------------------------------------------------------------
# Linear


class _Linear(torch.autograd.Function):
    """``linear``'s values forward, default matmuls in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return linear_values(x, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad.t() @ x if ctx.needs_input_grad[1] else None
        return grad_x, grad_weight


def linear_values(x: torch.Tensor, weight: torch.Tensor, weight_t: torch.Tensor | None = None) -> torch.Tensor:
    """``linear``'s values for ``x [M, K]``, without autograd."""
    if x.is_cuda:
        return _triton().matmul(x, weight)
    return cpu_kernels.matmul(x, transposed(weight) if weight_t is None else weight_t).to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           weight_t: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with each row of ``x[..., K]`` computed independently of
    the others: a row's result does not depend on the leading shape of ``x``.

    CPU: ``cpu_kernels.matmul`` in fp32 (each element one fmaf chain over K, in order: the same
    bits on any CPU), rounded once to ``x``'s dtype; ``weight_t`` is ``weight``'s fp32 transpose
    when the caller keeps it. CUDA: a Triton matmul with one fixed tile shape and the whole K reduction inside each
    tile, in order. ``bias`` is added to that result, elementwise (so invariant too). Backward
    uses the default matmuls.
    """
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear: x {tuple(x.shape)} does not match weight {tuple(weight.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"linear: x is {x.dtype} but weight is {weight.dtype}")
    if bias is not None and (bias.shape != weight.shape[:1] or bias.dtype != weight.dtype):
        raise ValueError(f"linear: bias {tuple(bias.shape)} {bias.dtype} does not match weight "
                         f"{tuple(weight.shape)} {weight.dtype}")
    rows = x.reshape(-1, x.shape[-1])
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        out = _Linear.apply(rows, weight)
    else:
        out = linear_values(rows, weight, weight_t)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """CUDA: ``x``'s rows in groups, ``counts[e]`` rows for expert ``e`` in expert order, each
    group through ``linear(rows, weight[e])`` (``weight [E, out, in]``) with its bits, in one
    launch that reads ``counts`` on the GPU (a CUDA graph can hold it). Backward: torch's grouped
    GEMMs, as the default mode's experts run them."""
    if x.dtype != weight.dtype:
        raise ValueError(f"grouped_linear: x is {x.dtype} but weight is {weight.dtype}")
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _GroupedLinear.apply(x, weight, counts)
    return _triton().grouped_matmul(x, weight, counts)


class _GroupedLinear(torch.autograd.Function):
    """``grouped_linear``'s values forward, the default grouped GEMMs backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight, counts)
        return _triton().grouped_matmul(x, weight, counts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, counts = ctx.saved_tensors
        grad_x, grad_weight = grouped_linear_backward(x, weight, counts, grad, *ctx.needs_input_grad[:2])
        return grad_x, grad_weight, None


def grouped_linear_backward(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, grad: torch.Tensor,
                            needs_x: bool = True, needs_weight: bool = True
                            ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The gradients of ``x`` and ``weight`` of a grouped linear (``x``'s rows in groups of
    ``counts``, group ``e`` times ``weight[e].T``) given the output's ``grad``: the grouped GEMMs
    torch's autograd runs for ``torch._grouped_mm(x, weight.transpose(-2, -1), offs)``."""
    offs = counts.cumsum(0, dtype=torch.int32)
    grad = grad.contiguous()
    grad_x = torch._grouped_mm(grad, weight, offs=offs) if needs_x else None
    grad_weight = torch._grouped_mm(x.t(), grad, offs=offs).transpose(-2, -1) if needs_weight else None
    return grad_x, grad_weight


def linear_add(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``residual + linear(x, weight)`` on CUDA without autograd, the addition in the matmul's
    own launch with the rounding of a separate addition (a GPU test checks): an engine's decode
    steps pay for every launch."""
    rows = x.reshape(-1, x.shape[-1])
    out = _triton().matmul(rows, weight, residual.reshape(rows.shape[0], -1))
    return out.view(*x.shape[:-1], -1)


def project(rows: torch.Tensor, weights: Sequence[torch.Tensor],
            stacked_t: torch.Tensor | None = None) -> list[torch.Tensor]:
    """``[linear(rows, w) for w in weights]`` bit for bit on CPU, as one ``cpu_kernels.matmul``
    by the weights stacked (the kernel computes each output element alone, so the stacked
    product has the bits of the separate ones); backward uses the default matmuls.
    ``stacked_t``: ``transposed(torch.cat(weights))`` when the caller keeps it."""
    if torch.is_grad_enabled() and (rows.requires_grad or any(w.requires_grad for w in weights)):
        return list(_Project.apply(rows, *weights))
    return _project_values(rows, weights, stacked_t)


def _project_values(rows: torch.Tensor, weights: Sequence[torch.Tensor],
                    stacked_t: torch.Tensor | None = None) -> list[torch.Tensor]:
    """``rows @ w.T`` for each of ``weights``, in one ``cpu_kernels.matmul``, each contiguous;
    ``stacked_t`` is ``transposed(torch.cat(weights))`` when the caller keeps it."""
    if stacked_t is None:
        stacked_t = transposed(torch.cat(weights))
    out = cpu_kernels.matmul(rows, stacked_t).to(rows.dtype)
    return [part.contiguous() for part in out.split([w.shape[0] for w in weights], dim=-1)]


def transposed(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` as the CPU matmul kernel reads it: fp32 ``[K, N]``, contiguous."""
    return weight.detach().t().to(torch.float32).contiguous()


class _Project(torch.autograd.Function):
    """``_project_values`` forward, default matmuls in backward (the gradients of separate
    linears of one input)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.save_for_backward(rows, *weights)
        return tuple(_project_values(rows, weights))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        rows, *weights = ctx.saved_tensors
        grad_rows = None
        if ctx.needs_input_grad[0]:
            for grad, weight in zip(grads, weights):
                grad_rows = grad @ weight if grad_rows is None else grad_rows.addmm_(grad, weight)
        grad_weights = (grad.t() @ rows if needed else None for grad, needed in zip(grads, ctx.needs_input_grad[1:]))
        return (grad_rows, *grad_weights)


# ------------------------------------------------------------------------------------------------
# Row-wise ops


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The decoder's ``rms_norm`` with each row reduced on its own, in one fixed order: as it is
    on CPU (torch reduces each contiguous row on its own, in one order), a one-program-per-row
    Triton kernel on CUDA (whose gradient is the decoder's ``rms_norm``'s)."""
    if not x.is_cuda:
        return decoder.rms_norm(x, weight, eps)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNorm.apply(x, weight, eps)
    return _triton().rms_norm(x, weight, eps)


class _RMSNorm(torch.autograd.Function):
    """``rms_norm``'s Triton values forward; ``rms_norm_backward`` backward (the kernel's output
    has no autograd graph of its own)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return _triton().rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        return (*closed_form_backward(rms_norm_backward, x, weight, grad, ctx.eps), None)


def rms_norm_backward(x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of the decoder's ``rms_norm(x, weight, eps)`` (x's, weight's) for ``grad``:
    with ``n = x * r``, ``r = rsqrt(mean(x**2) + eps)``, ``d x = r * (d n - n * mean(d n * n))``."""
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    normed = x32 * rstd
    grad32 = grad.float()
    grad_weight = (grad32 * normed.to(x.dtype).float()).reshape(-1, x.shape[-1]).sum(0)
    grad_normed = grad32 * weight.float()
    grad_x = rstd * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))
    return grad_x.to(x.dtype), grad_weight.to(weight.dtype)


def closed_form_backward(fn, *args):
    """``fn(*args)``, a backward written out in closed form: torch.compile'd for CUDA tensors,
    where it fuses into a few kernels (a backward's rounding is free: only forward values must
    match the generator), eager on CPU."""
    return (_compiled(fn) if args[0].is_cuda else fn)(*args)


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=True)


def default_gradients(op, inputs: Sequence[torch.Tensor], needs_input_grad: Sequence[bool],
                      grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """The backward of a kernel whose forward values come from elsewhere: the gradients of the
    default ``op(*inputs)`` at the same inputs, for those that need one (None for the others)."""
    with torch.enable_grad():
        inputs = [t.detach().requires_grad_(needed) for t, needed in zip(inputs, needs_input_grad)]
        wanted = [t for t in inputs if t.requires_grad]
        grads = iter(torch.autograd.grad(op(*inputs), wanted, grad))
    return tuple(next(grads) if t.requires_grad else None for t in inputs)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, silu computed in fp32 as ``g / (1 + exp(-g))``; backward
    ``silu_mul_backward``.

    torch's ``F.silu`` and ``exp`` can round an element differently when it falls in the scalar
    tail of a vectorized loop (or of a thread's share), so its value would depend on where it sits
    in the tensor: on CPU ``cpu_kernels.silu`` computes each element alone.
    """
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _SiluMul.apply(gate, up)
    return _silu_mul_values(gate, up)


def _silu_mul_values(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if gate.is_cuda:  # the same roundings in one kernel: decode steps pay for every launch
        return _triton().silu_mul(gate, up)
    return cpu_kernels.silu(gate).to(gate.dtype) * up


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return _silu_mul_values(gate, up)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return closed_form_backward(silu_mul_backward, *ctx.saved_tensors, grad)


def silu_mul_backward(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of ``silu(gate) * up`` (gate's, up's) for ``grad``:
    ``silu'(g) = sigmoid(g) + silu(g) * (1 - sigmoid(g))``."""
    gate32, grad32 = gate.float(), grad.float()
    sigmoid = torch.sigmoid(gate32)
    silu = gate32 * sigmoid
    grad_gate = grad32 * up.float() * (sigmoid + silu * (1 - sigmoid))
    return grad_gate.to(gate.dtype), (grad32 * silu).to(up.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The decoder's ``apply_rope`` (elementwise, so batch-invariant on CPU as it is) in true
    on-policy mode: on CUDA one Triton kernel with its roundings (decode
    steps pay for every launch); backward ``rope_backward``, written out instead of replaying the
    eager ops one by one."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _RoPE.apply(x, cos, sin)
    return _rope_values(x, cos, sin)


def _rope_values(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _triton().rope(x, cos, sin) if x.is_cuda else decoder.apply_rope(x, cos, sin)


class _RoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rope_values(x, cos, sin)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return closed_form_backward(rope_backward, grad, *ctx.saved_tensors), None, None


def rope_backward(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The gradient of the decoder's ``apply_rope``'s ``x`` for ``grad``: ``x * cos + rotate_half(x) * sin`` is
    linear in ``x``, so it is ``grad * cos + rotate_half^T(grad * sin)``, where
    ``rotate_half^T([a, b]) = [b, -a]``."""
    grad32 = grad.float()
    first, second = (grad32 * sin[:, None, :].float()).chunk(2, dim=-1)
    return (grad32 * cos[:, None, :].float() + torch.cat((second, -first), dim=-1)).to(grad.dtype)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """fp32 ``log_softmax`` over the last dim, one fixed reduction order per row."""
    logits = logits.float()
    if logits.is_cuda:
        return logits - _triton().logsumexp(logits)[..., None]
    return logits.log_softmax(-1)


def softmax(logits: torch.Tensor) -> torch.Tensor:
    """fp32 softmax over the last dim as ``exp(log_softmax)``; softmax's gradient backward."""
    return _Softmax.apply(logits)


class _Softmax(torch.autograd.Function):
    """``exp(log_softmax)`` forward, softmax's gradient backward (the CUDA log_softmax's values
    have no autograd graph of their own)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor) -> torch.Tensor:
        probs = log_softmax(logits).exp()
        ctx.save_for_backward(probs)
        ctx.dtype = logits.dtype
        return probs

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (probs,) = ctx.saved_tensors
        return (probs * (grad - (grad * probs).sum(-1, keepdim=True))).to(ctx.dtype)


# ------------------------------------------------------------------------------------------------
# CUDA


@functools.cache
def _triton():
    """The Triton kernels (imported on first CUDA use: Triton is not needed on CPU)."""
    from rlactors.on_policy import ops_triton

    return ops_triton
