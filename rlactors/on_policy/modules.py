"""True on-policy as a conversion of the plain decoder: ``to_batch_invariant`` swaps each of its
modules for a subclass that runs the batch-invariant ops of ``rlactors.on_policy.ops``, so that a
token's logprob (and its experts) do not depend on what else is in the batch.

A swap changes a module's class only: its parameters, their names and ties, and any hooks stay,
so a checkpoint loads into the converted model as into the plain one. Attention is not swapped:
the caller passes it (``rlactors.on_policy.sides`` says which).

The converted decoder layer hands each residual to the sublayer's output projection, which adds
it after its matmul (the same rounding as the plain layer's ``x + sublayer(x)``); an inference
engine's frozen linears on CUDA add it inside the matmul's launch (``ops.linear_add``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from rlactors.models.decoder import MLP, Attention, DecoderLayer, LogSoftmax, RMSNorm, SelfAttention
from rlactors.models.moe import Experts, SparseMoeBlock, linear_per_expert
from rlactors.on_policy import ops


class InvariantLinear(nn.Linear):
    """``ops.linear`` (each row on its own), plus ``residual`` when given; backward uses the
    default matmuls. A trainer's linears: they always run the separate ops, so the GPU bitwise
    tests of trainer against engine cover the engine's fusions."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        out = ops.linear(x, self.matmul_weight(), self.bias)
        return out if residual is None else residual + out

    def matmul_weight(self) -> torch.Tensor:
        """The weight this linear multiplies by: its own (a LoRA subclass merges its adapters in)."""
        return self.weight


class FrozenInvariantLinear(InvariantLinear):
    """An inference engine's ``InvariantLinear``, whose weights change only by in-place loads: on
    CPU it keeps the weight's fp32 transpose, which the kernel reads, until the weight's version
    counter moves; on CUDA it adds a residual in the matmul's launch. ``stack_weights`` may make
    its weight a view of ``stacked_weight``, which ``project`` multiplies by."""

    _transposed: tuple[torch.Tensor, int, torch.Tensor] | None = None  # (weight, version, fp32 w.T)
    _stacked: tuple[tuple, torch.Tensor] | None = None  # project()'s: ((weight, version)s, fp32 w.T)
    stacked_weight: torch.Tensor | None = None  # stack_weights()'s, on the first of the linears

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if x.is_cuda:
            if residual is not None and self.bias is None and not torch.is_grad_enabled():
                return ops.linear_add(x, self.weight, residual)
            out = ops.linear(x, self.weight, self.bias)
        else:
            weight = self.weight
            if self._transposed is None or self._transposed[0] is not weight or self._transposed[1] != weight._version:
                self._transposed = (weight, weight._version, ops.transposed(weight))
            out = ops.linear(x, weight, self.bias, weight_t=self._transposed[2])
        return out if residual is None else residual + out


def project(x: torch.Tensor, linears: Sequence[InvariantLinear]) -> list[torch.Tensor]:
    """``[m(x) for m in linears]``, bit for bit: several projections of one input (q/k/v,
    gate/up).

    On CPU, ``x`` is multiplied once by their weights stacked (``ops.project``); frozen linears
    keep the stacked transpose until a weight's version moves, a trainer's make it at each call.
    On CUDA, frozen linears whose weights ``stack_weights`` made one tensor run as one matmul
    without autograd, others one by one.
    """
    first = linears[0]
    if x.is_cuda:
        stacked = isinstance(first, FrozenInvariantLinear) and first.stacked_weight is not None
        if not stacked or torch.is_grad_enabled():
            return [m(x) for m in linears]
        return _project_stacked(x, linears)
    weights = [m.matmul_weight() for m in linears]
    if any(w.shape[1] != x.shape[-1] or w.dtype != x.dtype for w in weights):
        raise ValueError(f"project: x {tuple(x.shape)} {x.dtype} does not match the weights "
                         f"{[tuple(w.shape) for w in weights]} {weights[0].dtype}")
    stacked = None
    if all(isinstance(m, FrozenInvariantLinear) for m in linears) and not torch.is_grad_enabled():
        key = tuple((w, w._version) for w in weights)
        if first._stacked is None or any(a is not b or u != v for (a, u), (b, v) in zip(first._stacked[0], key)):
            first._stacked = (key, ops.transposed(torch.cat(weights)))
        stacked = first._stacked[1]
    parts = ops.project(x.reshape(-1, x.shape[-1]), weights, stacked)
    outputs = []
    for m, part in zip(linears, parts):
        part = part.view(*x.shape[:-1], -1)
        outputs.append(part if m.bias is None else part + m.bias)
    return outputs


def stack_weights(linears: Sequence[FrozenInvariantLinear]) -> None:
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


def _project_stacked(x: torch.Tensor, linears: Sequence[FrozenInvariantLinear]) -> list[torch.Tensor]:
    """``project`` by the stacked weight of ``linears`` (``stack_weights``): one matmul, the
    outputs column blocks (views) of its result."""
    stacked = linears[0].stacked_weight
    if linears[0].weight.data_ptr() != stacked.data_ptr() or sum(m.weight.shape[0] for m in linears) != len(stacked):
        raise RuntimeError("project: these linears' weights are no longer views of their stacked weight "
                           "(replaced after stack_weights?)")
    out = ops.linear_values(x.reshape(-1, x.shape[-1]), stacked)
    parts = out.split([m.weight.shape[0] for m in linears], dim=-1)
    return [(part if m.bias is None else part + m.bias).view(*x.shape[:-1], -1) for m, part in zip(linears, parts)]


class InvariantRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class InvariantSelfAttention(SelfAttention):
    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: Attention,
                residual: torch.Tensor) -> torch.Tensor:
        """``residual`` plus the attention's output (the o_proj adds it)."""
        T = x.shape[0]
        q, k, v = project(x, (self.q_proj, self.k_proj, self.v_proj))
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = ops.rope(q, cos, sin), ops.rope(k, cos, sin)
        out = attention(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim), residual)


class InvariantMLP(MLP):
    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual`` plus the MLP's output (the down_proj adds it)."""
        return self.down_proj(ops.silu_mul(*project(x, (self.gate_proj, self.up_proj))), residual)


class InvariantSparseMoeBlock(SparseMoeBlock):
    """The router's softmax as ``exp(ops.log_softmax)``; the rest of the routing (a stable top-k,
    the weighted sum in rank order) is invariant as it is."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return residual + self.experts(x, *self.route(ops.softmax(self.gate(x)), x.dtype))


class InvariantExperts(Experts):
    """Each expert's matmul is ``ops.linear`` over its rows (each row's result depends on that
    row alone, so not on how many tokens the expert got); the activation ``ops.silu_mul``. On
    CUDA all experts go in one launch with those bits (``ops.grouped_linear``), which never waits
    for the token counts on the host, so CUDA graphs can hold an engine's layer."""

    def grouped_linear(self, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return ops.grouped_linear(x, weight, counts)
        return linear_per_expert(x, weight, counts, ops.linear)

    def activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return ops.silu_mul(gate.contiguous(), up.contiguous())


class InvariantDecoderLayer(DecoderLayer):
    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: Attention) -> torch.Tensor:
        x = self.self_attn(self.input_layernorm(x), cos, sin, attention, residual=x)
        return self.mlp(self.post_attention_layernorm(x), residual=x)


class InvariantLogSoftmax(LogSoftmax):
    """Log-probabilities as the batch-invariant generator computes them: the full rows from
    ``ops.log_softmax``, the targets' taken from them (``target_logprobs``), and the trainer's
    logsumexp and entropy derived from those, eagerly (not by the plain class's fused kernels)."""

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return ops.log_softmax(logits)

    def target_logprobs(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(log p(targets[t]) [T], the full log-probabilities [T, vocab] or None)``: the latter
        when computing the former made them."""
        logprobs = self(logits)
        return logprobs.gather(-1, targets[:, None]).squeeze(-1), logprobs

    def at_targets(self, logits: torch.Tensor, targets: torch.Tensor,
                   with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        target_logprobs, logprobs = self.target_logprobs(logits, targets)
        # log_softmax = logits - logsumexp, so the target's entries give the logsumexp at O(T)
        # cost, consistent with the log_softmax's own rounding (measured at Qwen3's vocab:
        # exp(logits - logsumexp) is within 4e-6 relative of exp(log_softmax)).
        logsumexp = logits.gather(-1, targets[:, None]).squeeze(-1) - target_logprobs
        if not with_entropy:
            return target_logprobs, logsumexp, None
        if logprobs is None:
            logprobs = self(logits)
        return target_logprobs, logsumexp, -(logprobs.exp() * logprobs).sum(-1)

    def grad_logits(self, logits: torch.Tensor, logsumexp: torch.Tensor, targets: torch.Tensor,
                    grad: torch.Tensor) -> torch.Tensor:
        """The plain class's gradient, bit for bit, in fewer eager passes (this mode runs eager):
        it overwrites ``logits``, which the trainer's head discards."""
        probs = (logits - logsumexp[:, None]).exp_()  # fp32: the logits upcast by the logsumexp
        probs.scatter_add_(-1, targets[:, None], torch.full_like(grad[:, None], -1.0))  # p - onehot(y)
        return torch.mul(probs, -grad[:, None], out=logits)


SWAPS: dict[type[nn.Module], type[nn.Module]] = {
    nn.Linear: InvariantLinear,
    RMSNorm: InvariantRMSNorm,
    SelfAttention: InvariantSelfAttention,
    MLP: InvariantMLP,
    SparseMoeBlock: InvariantSparseMoeBlock,
    Experts: InvariantExperts,
    DecoderLayer: InvariantDecoderLayer,
    LogSoftmax: InvariantLogSoftmax,
}


def to_batch_invariant(model: nn.Module, weights_frozen: bool = False,
                       log_softmax: type[LogSoftmax] = InvariantLogSoftmax) -> None:
    """Converts the plain decoder ``model`` in place: every module of a class in ``SWAPS`` becomes
    its batch-invariant subclass. ``weights_frozen``: the weights change only by in-place loads (an
    inference engine), so the linears may keep per-weight work between calls
    (``FrozenInvariantLinear``). ``log_softmax``: the class of the model's log-probabilities (the
    trainer of a vLLM generator computes them with vLLM's kernel). Call it before anything wraps
    a module's forward (activation checkpointing, torch.compile, FSDP)."""
    swaps = {**SWAPS, LogSoftmax: log_softmax}
    if weights_frozen:
        swaps[nn.Linear] = FrozenInvariantLinear
    for module in model.modules():
        if type(module) in swaps:
            module.__class__ = swaps[type(module)]
