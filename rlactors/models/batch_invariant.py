"""Batch-invariant ops: the kernels of the true on-policy mode.

An op is *batch-invariant* when the value it computes for one row (one token) is bitwise the
same whatever else is computed in the same call: how many other rows there are, which ones, and
where the row sits among them. When every op of the model is, a token's logprob is the same
number in the generator (a decode step among whatever the engine was running, or a prefill
chunk) and in the trainer (a packed microbatch), and the on-policy update is really on-policy.

What breaks it with the default ops, and the fix (measured on CPU with torch 2.13 + MKL and on
an H200; pinned by tests/models/test_batch_invariant.py):

- matmul: the BLAS picks its kernel, its blocking of K and its thread split from the whole
  shape, and on CPU also from the CPU's vendor and instruction set, so a row's dot products are
  summed in another order when the number of rows changes (MKL fp32 on one Intel CPU: M < 16
  takes another path, for K >= 1024 rows differ up to M ~ 256; on an AMD CPU rows differ even in
  MKL's strict reproducibility mode). CPU fix: ``exact_matmul``. Every row is rounded to integers
  times a power of two (20 to 23 bits) and the products are summed in fp64, where each partial
  sum is an exact integer, so the BLAS's order cannot change a bit, on any CPU. CUDA fix: a
  Triton matmul with one fixed tile shape that sums K in fixed chunks, each in order, and adds
  the chunks in order (cuBLAS picks split-K by shape).
- silu / sigmoid: torch's vectorized CPU loop computes the tail of a tensor with the scalar
  function, which rounds differently, so an element's value depends on its index in the tensor.
  Fix: ``silu_mul`` spells silu with exp and a division, which round the same on both paths.
- attention: each side splits keys and batches queries its own way. Fix: one function for both,
  in ``rlactors.attention.invariant`` (it uses the exact products below on CPU).
- row reductions on CUDA (RMSNorm's mean, log_softmax): torch sizes its blocks by the number of
  rows. Fix: one-program-per-row Triton kernels. On CPU torch's own kernels (not the BLAS)
  reduce a contiguous row in an order set by its length and the vector width alone, whatever the
  number of rows, and embedding lookups and exact elementwise ops (RoPE) are invariant anywhere.
  torch's exp, log and sqrt give the same bits on its vectorized and scalar paths for every fp32
  input (checked exhaustively with its AVX2 and AVX-512 kernels: benchmarks/elementwise_paths.py), so
  an element's place in a tensor does not matter.

Backward passes use the default kernels: only forward values must match the generator, and a
gradient computed in another summation order is just as correct. That keeps the trainer's cost
close to the default mode's.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

# ------------------------------------------------------------------------------------------------
# Exact CPU matmuls

# fp64 represents every integer of magnitude <= 2**53 exactly.
_EXACT_BITS = 53


def fixed_point_bits(reduced: int) -> int:
    """Integer bits per operand for an exact fp64 dot product of ``reduced`` terms: with both
    operands' integers of magnitude <= 2**bits, every partial sum is an integer of magnitude <=
    reduced * 2**(2 * bits) <= 2**53."""
    return (_EXACT_BITS - max(reduced - 1, 0).bit_length()) // 2


# An fp64 with its mantissa bits cleared is the largest power of two <= it (for a normal number).
_EXPONENT_FIELD = 0x7FF0000000000000
# A row whose largest magnitude is below this is rounded as if it were this: every scale stays a
# normal fp64, and no fp32, bf16 or fp16 value is that small, so their rows never take this path.
_SMALLEST_LEADING_POWER = 2.0**-200


def _leading_power(x: torch.Tensor, nonnegative: bool = False) -> torch.Tensor:
    """fp64 ``[..., 1]``: per row of ``x`` (last dim), the largest power of two <= its largest
    magnitude, or ``2**-200`` when that is smaller (a zero row). ``nonnegative``: ``x`` has no
    negative entries, so its largest entry is its largest magnitude."""
    largest = x.amax(-1, keepdim=True)
    if not nonnegative:  # amax and amin: no |x| temporary; torch's aminmax is several times slower here
        largest = torch.maximum(largest, x.amin(-1, keepdim=True).neg_())
    largest = largest.double().clamp_(min=_SMALLEST_LEADING_POWER)
    return (largest.view(torch.int64) & _EXPONENT_FIELD).view(torch.float64)


def _round_at(x: torch.Tensor, leading_power: torch.Tensor, bits: int, overwrite: bool = False) -> torch.Tensor:
    """``x`` in fp64 with each row rounded to a multiple of ``2 * leading_power * 2**-bits``.

    ``(x + c) - c`` with ``c = 1.5 * 2**52`` times that unit: ``c``'s last mantissa bit is the
    unit, and ``x + c`` stays in ``c``'s binade (``|x| < 2 * leading_power``), so the one IEEE
    addition rounds ``x`` at the unit (to nearest, ties to even) and the subtraction is exact.
    ``overwrite``: an fp64 ``x`` is rounded in place."""
    shift = leading_power * (1.5 * 2.0 ** (53 - bits))
    # Converted first, then in place: torch.add(fp32, fp64) converts into a temporary of its own.
    rounded = x if overwrite and x.dtype == torch.float64 else x.to(torch.float64, copy=True)
    return rounded.add_(shift).sub_(shift)


def rounded_rows(x: torch.Tensor, bits: int | None = None) -> torch.Tensor:
    """``x`` in fp64 with each row (last dim) rounded to a multiple of ``2**(e - bits)``, where
    ``2**e`` is the least power of two above the row's largest magnitude (at least ``2**-199``);
    ``bits`` defaults to the most that keeps a dot product of two such rows exact
    (``fixed_point_bits``).

    So a rounded row is an integer times ``2**(e - bits)``, at most ``2**bits`` in magnitude, and
    it depends on that row's values alone (rounded to nearest, ties to even). Cast back to ``x``'s
    dtype it is exact (a multiple of a power of two no finer than the entry's own last bit, or the
    entry itself), unless a row within one ulp of the dtype's largest finite value rounds up.
    """
    bits = bits or fixed_point_bits(x.shape[-1])
    return _round_at(x, _leading_power(x), bits)


def exact_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 ``a @ b.mT`` (``a [..., M, K]``, ``b [..., N, K]``, broadcast batch dims) in which an
    output element depends only on its own row of ``a`` and row of ``b``, on any BLAS.

    ``rounded_rows`` turns every row into integers times one power of two, with ``bits`` from
    ``fixed_point_bits(K)``. The terms of a dot product then share one power of two, and every
    partial sum, in fp64, is an integer small enough to be exact: the sum is the same in any
    order, so whatever blocking, thread split, kernel or instruction set the BLAS picks for this
    shape, the result is the exact dot product of the rounded rows, rounded once to fp32. The
    input rounding costs at most ``2**-bits`` of the row's largest entry (22 or more bits for
    K <= 512, 20 for K <= 8192): results are close to fp32 matmuls, not equal to them.
    """
    return torch.matmul(rounded_rows(a), rounded_rows(b).mT).float()


def weighted_sum_bits(reduced: int) -> int:
    """Bits to which ``exact_weighted_sum`` rounds the rows of its values and of its scaled
    weights, for ``reduced`` values: ``fixed_point_bits(2 * reduced)``, one bit short of
    ``fixed_point_bits(reduced)`` at most, for the value integers may reach ``2**(bits + 1)``."""
    return fixed_point_bits(2 * reduced)


def exact_weighted_sum(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """fp32 ``weights @ values`` (``weights [..., M, K]``, ``values [..., K, N]``), exact as in
    ``exact_matmul``, with each row of ``values`` rounded on its own (``rounded_rows`` at
    ``weighted_sum_bits(K)``): ``weighted_sum_of_rounded`` of those rows."""
    bits = weighted_sum_bits(values.shape[-2])
    return weighted_sum_of_rounded(weights, rounded_rows(values, bits), bits)


def row_powers(x: torch.Tensor) -> torch.Tensor:
    """fp64 ``x.shape[:-1]``: per row of ``x``, the largest power of two <= its largest magnitude
    (at least ``2**-200``): for a row of values ``rounded_rows`` made, the power of two that
    ``weighted_sum_of_rounded`` reads back from it, for a caller that keeps it with the row."""
    return _leading_power(x)[..., 0]


def weighted_sum_of_rounded(weights: torch.Tensor, values: torch.Tensor, bits: int, *,
                            value_powers: torch.Tensor | None = None, nonnegative_weights: bool = False,
                            overwrite_values: bool = False, scaled_out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``weights @ values``, summed exactly, for ``values`` whose rows ``rounded_rows(., bits)``
    made (in any dtype that holds them exactly) with ``bits = weighted_sum_bits(K)``.

    Rounding the columns of ``values`` would tie a value's rounding to every other row of
    ``values``. Here row ``k`` is an integer (at most ``2**(bits + 1)``: a rounded row's largest
    entry may have reached the next power of two) times ``2**s_k``, where ``2**(s_k + bits)`` is
    the largest power of two <= the row's largest magnitude, read back from the rounded row
    itself (``row_powers``; ``value_powers [..., K]`` when the caller kept them); that power of
    two moves, exactly, into column ``k`` of ``weights``, whose rows are then rounded to
    ``bits``, and the fp64 sums of integers are exact in any order. A zero weight stays an exact
    zero, so a row of ``values`` that the weights ignore (a hidden key) changes no result,
    whatever it holds, as long as it is finite.

    Passes and temporaries the caller can spare: ``nonnegative_weights`` (softmax weights) skips
    the weights' minimum; ``overwrite_values`` turns fp64 ``values`` into their integers in
    place; ``scaled_out`` (fp64, ``weights``' shape) receives the scaled weights.
    """
    power = _leading_power(values) if value_powers is None else value_powers[..., None]  # [..., K, 1]
    value_ints = values if overwrite_values and values.dtype == torch.float64 else values.to(torch.float64, copy=True)
    value_ints.mul_(power.reciprocal().mul_(2.0**bits))  # exact
    scaled = torch.mul(weights, (power * 2.0**-bits).mT, out=scaled_out)  # exact, in fp64
    rounded = _round_at(scaled, _leading_power(scaled, nonnegative_weights), bits, overwrite=True)
    return torch.matmul(rounded, value_ints).float()


# ------------------------------------------------------------------------------------------------
# Linear


class _Linear(torch.autograd.Function):
    """``linear``'s values forward, default matmuls in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return _linear_values(x, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad.t() @ x if ctx.needs_input_grad[1] else None
        return grad_x, grad_weight


def _linear_values(x: torch.Tensor, weight: torch.Tensor, rounded_weight: torch.Tensor | None = None) -> torch.Tensor:
    if x.is_cuda:
        return _triton().matmul(x, weight)
    if rounded_weight is None:
        rounded_weight = rounded_rows(weight)
    return torch.matmul(rounded_rows(x), rounded_weight.mT).to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           rounded_weight: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with each row of ``x[..., K]`` computed independently of
    the others: a row's result does not depend on the leading shape of ``x``.

    CPU: ``exact_matmul``'s exact integer sums (the same bits on any BLAS, CPU and thread count),
    rounded once to ``x``'s dtype; ``rounded_weight`` is ``rounded_rows(weight)`` when the caller
    keeps it. CUDA: a Triton matmul with one fixed tile shape and the whole K reduction inside each
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
        out = _linear_values(rows, weight, rounded_weight)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """``nn.Linear`` (no bias unless asked) that runs ``linear`` while ``batch_invariant`` is set
    (the model's ``set_batch_invariant`` sets it); parameter names and init are nn.Linear's.

    With ``weights_frozen`` (an inference engine, whose weights change only by in-place loads) the
    CPU path keeps ``rounded_rows(weight)`` until the weight's version counter moves, instead of
    rounding the weight on every call, and the CUDA path adds a residual in the matmul's launch.
    A trainer's linears (not frozen) always run the separate ops, so the GPU bitwise tests of
    trainer against engine cover the engine's fusions.
    """

    batch_invariant = False
    weights_frozen = False

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self._rounded: tuple[torch.Tensor, int, torch.Tensor] | None = None  # (weight, version, rounded)
        self._stacked: tuple[tuple, torch.Tensor] | None = None  # project()'s: ((weight, version)s, rounded)
        self.stacked_weight: torch.Tensor | None = None  # stack_weights()'s, on the first of the linears

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The projection of ``x``, plus ``residual`` (shaped as the output) when given."""
        if not self.batch_invariant:
            out = F.linear(x, self.weight, self.bias)
        elif self.weights_frozen and x.is_cuda and residual is not None and self.bias is None \
                and not torch.is_grad_enabled():
            # An engine's decode steps pay for every launch: the residual is added in the
            # matmul's own, with the roundings of the addition below (a GPU test checks).
            rows = x.reshape(-1, x.shape[-1])
            out = _triton().matmul(rows, self.weight, residual.reshape(rows.shape[0], -1))
            return out.view(*x.shape[:-1], -1)
        elif not self.weights_frozen or x.is_cuda:
            out = linear(x, self.weight, self.bias)
        else:
            weight = self.weight
            if self._rounded is None or self._rounded[0] is not weight or self._rounded[1] != weight._version:
                self._rounded = (weight, weight._version, rounded_rows(weight))
            out = linear(x, weight, self.bias, rounded_weight=self._rounded[2])
        return out if residual is None else residual + out


def project(x: torch.Tensor, linears: Sequence[Linear]) -> list[torch.Tensor]:
    """``[m(x) for m in linears]``, bit for bit: several projections of one input (q/k/v,
    gate/up).

    For CPU linears in batch-invariant mode, ``x`` is rounded once and multiplied once by their
    rounded weights stacked: ``exact_matmul``'s sums give each output element the bits it has
    when computed alone. An inference engine's frozen linears keep the stacked rounded weights
    until a weight's version moves; otherwise (a trainer) they are rounded at each call, and
    backward uses the default matmuls, as ``linear``'s does. On CUDA, linears whose weights
    ``stack_weights`` made one tensor (an inference engine's) run as one matmul without autograd,
    others one by one.
    """
    first = linears[0]
    if not all(m.batch_invariant for m in linears):
        return [m(x) for m in linears]
    if x.is_cuda:
        if first.stacked_weight is None or torch.is_grad_enabled():
            return [m(x) for m in linears]
        return _project_stacked(x, linears)
    weights = [m.weight for m in linears]
    if any(w.shape[1] != x.shape[-1] or w.dtype != x.dtype for w in weights):
        raise ValueError(f"project: x {tuple(x.shape)} {x.dtype} does not match the weights "
                         f"{[tuple(w.shape) for w in weights]} {weights[0].dtype}")
    rows = x.reshape(-1, x.shape[-1])
    if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)):
        parts = _Project.apply(rows, *weights)
    else:
        stacked = None
        if all(m.weights_frozen for m in linears):
            key = tuple((w, w._version) for w in weights)
            if first._stacked is None or any(a is not b or u != v for (a, u), (b, v) in zip(first._stacked[0], key)):
                first._stacked = (key, rounded_rows(torch.cat(weights)))
            stacked = first._stacked[1]
        parts = _project_values(rows, weights, stacked)
    outputs = []
    for m, part in zip(linears, parts):
        part = part.view(*x.shape[:-1], -1)
        outputs.append(part if m.bias is None else part + m.bias)
    return outputs


def stack_weights(linears: Sequence[Linear]) -> None:
    """Makes the weights of ``linears`` (one input size) consecutive row blocks of one tensor,
    ``linears[0].stacked_weight``, which ``project`` multiplies by in one matmul on CUDA: one
    launch instead of one per linear, for an inference engine's small decode steps. Each weight
    stays a parameter of its own name, a view into that tensor, so an in-place load into a weight
    is a load into it (also under a captured CUDA graph, which reads the tensor itself).

    A matmul's output element depends only on its row of ``x`` and its row of the weight (the
    Triton kernel's sums are fixed per element), so the stacked product has the bits of the
    separate ones the trainer runs.
    """
    stacked = torch.cat([m.weight.detach() for m in linears])
    start = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight = nn.Parameter(stacked[start:start + rows], requires_grad=m.weight.requires_grad)
        start += rows
    linears[0].stacked_weight = stacked


def _project_stacked(x: torch.Tensor, linears: Sequence[Linear]) -> list[torch.Tensor]:
    """``project`` by the stacked weight of ``linears`` (``stack_weights``): one matmul, the
    outputs column blocks (views) of its result."""
    stacked = linears[0].stacked_weight
    if linears[0].weight.data_ptr() != stacked.data_ptr() or sum(m.weight.shape[0] for m in linears) != len(stacked):
        raise RuntimeError("project: these linears' weights are no longer views of their stacked weight "
                           "(replaced after stack_weights?)")
    out = _linear_values(x.reshape(-1, x.shape[-1]), stacked)
    parts = out.split([m.weight.shape[0] for m in linears], dim=-1)
    return [(part if m.bias is None else part + m.bias).view(*x.shape[:-1], -1) for m, part in zip(linears, parts)]


def _project_values(rows: torch.Tensor, weights: Sequence[torch.Tensor],
                    rounded_stacked: torch.Tensor | None = None) -> list[torch.Tensor]:
    """``rows @ w.T`` for each of ``weights``, exact (``exact_matmul``) in one product, each
    contiguous; ``rounded_stacked`` is ``rounded_rows(torch.cat(weights))`` when the caller keeps
    it (a row of the stack is rounded on its own, so that is each weight's rounding)."""
    if rounded_stacked is None:
        rounded_stacked = rounded_rows(torch.cat(weights))
    out = torch.matmul(rounded_rows(rows), rounded_stacked.mT).to(rows.dtype)
    return [part.contiguous() for part in out.split([w.shape[0] for w in weights], dim=-1)]


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


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim with the rounding of HF's RMSNorm in every supported family:
    normalize in fp32, scale in the weight's dtype. The model's default; on CPU also batch-invariant
    (torch reduces each contiguous row on its own, in one order)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``torch_rms_norm`` with each row reduced on its own, in one fixed order: as it is on CPU,
    a one-program-per-row Triton kernel on CUDA (whose gradient is ``torch_rms_norm``'s)."""
    if not x.is_cuda:
        return torch_rms_norm(x, weight, eps)
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
    """The gradients of ``torch_rms_norm(x, weight, eps)`` (x's, weight's) for ``grad``:
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

    torch's ``F.silu`` rounds an element differently when it falls in the scalar tail of the
    vectorized loop, so its value depends on where it sits in the tensor; exp and division do not.
    """
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _SiluMul.apply(gate, up)
    return _silu_mul_values(gate, up)


def _silu_mul_values(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if gate.is_cuda:  # the same roundings in one kernel: decode steps pay for every launch
        return _triton().silu_mul(gate, up)
    gate32 = gate.float()
    return (gate32 / (1 + torch.exp(-gate32))).to(gate.dtype) * up


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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates ``x[T, H, D]`` by ``cos/sin[T, D]`` in HF's rotate-half layout: the model's default
    RoPE, with HF's roundings; elementwise, so batch-invariant on CPU too."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rope`` in true on-policy mode: on CUDA one Triton kernel with its roundings (decode
    steps pay for every launch); backward ``rope_backward``, written out instead of replaying the
    eager ops one by one."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _RoPE.apply(x, cos, sin)
    return _rope_values(x, cos, sin)


def _rope_values(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _triton().rope(x, cos, sin) if x.is_cuda else apply_rope(x, cos, sin)


class _RoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rope_values(x, cos, sin)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return closed_form_backward(rope_backward, grad, *ctx.saved_tensors), None, None


def rope_backward(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The gradient of ``apply_rope``'s ``x`` for ``grad``: ``x * cos + rotate_half(x) * sin`` is
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


# ------------------------------------------------------------------------------------------------
# CUDA


@functools.cache
def _triton():
    """The Triton kernels (imported on first CUDA use: Triton is not needed on CPU)."""
    from rlactors.models import batch_invariant_triton

    return batch_invariant_triton
