"""The decoder of every supported family (Qwen3, Qwen3-MoE, Qwen2/2.5, Llama 3.x), with Hugging
Face parameter names and injected attention.

The families differ only in switches read from ``ModelArgs`` (``args.family``): q/k/v biases
(Qwen2), a per-head q/k RMSNorm (Qwen3), RoPE scaling (Llama 3.1+), a tied or untied LM head,
and in Qwen3-MoE's sparse layers a mixture of experts (``rlactors.models.moe``) for the MLP.
Parameter names are each family's HF names, so checkpoints load and export without renaming.

Everything is packed 1-D: ``input_ids[T]`` holds several documents end to end and
``positions[T]`` restarts at 0 at each document start. The model never decides how tokens
attend to each other: the caller passes an ``attention(layer_idx, q, k, v)`` callable
(``VarlenAttention`` for training, a KV-cache attention in the native engine).

The model holds no mode: true on-policy is a conversion of this plain model
(``rlactors.on_policy.modules.to_batch_invariant`` swaps its modules for batch-invariant ones).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from rlactors.attention.varlen import VarlenAttention
from rlactors.models.args import Llama3RopeScaling, ModelArgs
from rlactors.models.moe import SparseMoeBlock

# attention(layer_idx, q[T, Hq, D], k[T, Hkv, D], v[T, Hkv, D]) -> out[T, Hq, D]
Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim with the rounding of HF's RMSNorm in every supported family:
    normalize in fp32, scale in the weight's dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates ``x[T, H, D]`` by ``cos/sin[T, D]`` in HF's rotate-half layout, with HF's roundings."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_inverse_frequencies(head_dim: int, theta: float,
                             scaling: Llama3RopeScaling | None = None) -> torch.Tensor:
    """``[head_dim // 2]`` fp32 inverse frequencies, computed on CPU with HF's ops in HF's order
    (for ``scaling``, transformers' ``_compute_llama3_parameters``), so they are HF's bit for bit."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    original = scaling.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are divided by factor, short ones kept ...
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    # ... and those between interpolated, linearly in original / wavelength.
    smooth = (original / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelength < original / high) * ~(wavelength > original / low)
    return torch.where(medium, smoothed, scaled)


class SelfAttention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = args.num_attention_heads
        self.num_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        bias = args.family.qkv_bias
        self.q_proj = nn.Linear(args.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, args.hidden_size, bias=False)
        self.q_norm = self.k_norm = None
        if args.family.qk_norm:  # per head, before RoPE
            self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: Attention) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attention(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.self_attn = SelfAttention(args, layer_idx)
        self.mlp = SparseMoeBlock(args) if args.is_sparse_layer(layer_idx) else MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention: Attention) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        # Passing the weight skips nn.Embedding's N(0, 1) init: weights come from a checkpoint,
        # and that init on the meta device costs seconds of lazy torch imports per process.
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size,
                                         _weight=torch.empty(args.vocab_size, args.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        # A plain attribute, not a buffer: it stays out of state_dict and survives meta-device
        # construction; rope() copies it to the device it needs.
        self.inv_freq = rope_inverse_frequencies(args.head_dim, args.rope_theta, args.rope_scaling)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [T, head_dim]`` for each token's own position, cast to ``dtype`` like HF."""
        inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attention) -> torch.Tensor:
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and positions must be 1-D of equal length (flatten 2-D batches), got "
                f"{tuple(input_ids.shape)} and {tuple(positions.shape)}")
        h = self.embed_tokens(input_ids)
        cos, sin = self.rope(positions, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin, attention)
        return self.norm(h)


def logprobs_logsumexp_entropy(logits: torch.Tensor, targets: torch.Tensor,
                               with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(log p(targets[t]), logsumexp(logits[t]), entropy[t] or None)`` of ``logits [T, vocab]``,
    in fp32 (fp64 logits stay fp64). Row reductions only: compiled, each reads the row in the
    logits' dtype and upcasts it in registers."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logsumexp = logits.logsumexp(-1)
    target_logprobs = logits.gather(-1, targets[:, None]).squeeze(-1) - logsumexp
    if not with_entropy:
        return target_logprobs, logsumexp, None
    logprobs = logits - logsumexp[:, None]
    return target_logprobs, logsumexp, -logprobs.exp().mul_(logprobs).sum(-1)


def logprob_grad_logits(logits: torch.Tensor, logsumexp: torch.Tensor, targets: torch.Tensor,
                        grad: torch.Tensor) -> torch.Tensor:
    """``grad[t] * (onehot(targets[t]) - softmax(logits[t]))``, the gradient of
    ``grad . log p(targets)`` wrt ``logits``: computed in ``logsumexp``'s dtype, rounded once
    into the logits'. One elementwise pass when compiled."""
    probs = (logits - logsumexp[:, None]).exp_()  # the logits upcast by the fp32 logsumexp
    is_target = torch.arange(logits.shape[-1], device=logits.device) == targets[:, None]
    return probs.neg_().add_(is_target).mul_(grad[:, None]).to(logits.dtype)


class LogSoftmax(nn.Module):
    """fp32 log-probabilities of ``logits [T, vocab]``: what the trainer and the engine use.

    The trainer's head (``_TokenLogprobs``) calls ``at_targets`` and ``grad_logits`` chunk by
    chunk; here they are ``logprobs_logsumexp_entropy`` and ``logprob_grad_logits``, eager unless
    ``compile_kernels`` compiled them (CUDA: no fp32 ``[T, vocab]`` tensor is then written).
    """

    def __init__(self):
        super().__init__()
        self._at_targets, self._grad_logits = logprobs_logsumexp_entropy, logprob_grad_logits

    def compile_kernels(self) -> None:
        """torch.compile's ``at_targets``' and ``grad_logits``' kernels, fusing each chunk's
        upcast, exp, reductions and gradient into passes over its logits."""
        self._at_targets = torch.compile(logprobs_logsumexp_entropy)
        self._grad_logits = torch.compile(logprob_grad_logits)

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.float().log_softmax(-1)

    def at_targets(self, logits: torch.Tensor, targets: torch.Tensor,
                   with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(log p(targets[t]), logsumexp(logits[t]), entropy[t] if with_entropy else None)``,
        each fp32 ``[T]``."""
        return self._at_targets(logits, targets, with_entropy)

    def grad_logits(self, logits: torch.Tensor, logsumexp: torch.Tensor, targets: torch.Tensor,
                    grad: torch.Tensor) -> torch.Tensor:
        """The gradient wrt ``logits`` of ``(grad * log p(targets)).sum()``, in the logits' dtype,
        from ``at_targets``' ``logsumexp``."""
        return self._grad_logits(logits, logsumexp, targets, grad)


class DecoderForCausalLM(nn.Module):
    """A causal LM of ``args.model_type``'s family; module tree and parameter names match that
    family's HF model (``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM`` as transformers 5 holds it in
    memory, ``Qwen2ForCausalLM``, ``LlamaForCausalLM``).

    A freshly constructed model holds placeholder values (the embedding is left uninitialized):
    load weights with ``rlactors.models.checkpoint.from_pretrained`` (``rlactors.models.tiny``
    writes random ones). Construct under ``torch.device("meta")`` to allocate nothing.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = DecoderModel(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.log_softmax = LogSoftmax()
        self.tie_weights()

    def tie_weights(self) -> None:
        """With tied embeddings, makes ``lm_head.weight`` the very tensor of ``embed_tokens``.

        Call again after anything that replaces parameters (``to_empty``, ``load_state_dict``
        with ``assign=True``).
        """
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attention) -> torch.Tensor:
        """``hidden[T, hidden_size]`` after the final norm."""
        return self.model(input_ids, positions, attention)

    def forward_packed(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       backend: str = "auto") -> torch.Tensor:
        """``forward`` with a ``VarlenAttention`` built from the document starts in ``positions``."""
        return self(input_ids, positions, VarlenAttention.from_positions(positions, backend))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[T, vocab_size]`` in the model's dtype."""
        return self.lm_head(hidden)

    def token_logprobs(self, hidden: torch.Tensor, target_ids: torch.Tensor,
                       chunk_size: int = 1024) -> torch.Tensor:
        """fp32 ``log p(target_ids[t] | hidden[t])`` for every ``t``; differentiable.

        The vocabulary projection and fp32 log_softmax run ``chunk_size`` tokens at a time and
        backward recomputes each chunk's logits (``_TokenLogprobs``), so the fp32 full-vocab
        logits of the whole batch never exist at once.
        """
        return self._token_logprobs(hidden, target_ids, chunk_size, with_entropy=False)[0]

    def token_logprobs_and_entropy(self, hidden: torch.Tensor, target_ids: torch.Tensor,
                                   chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logprobs, entropy)``, both fp32 ``[T]``; entropy of the full next-token distribution.

        Only the logprobs are differentiable: the entropy is a metric and comes back detached.
        """
        return self._token_logprobs(hidden, target_ids, chunk_size, with_entropy=True)

    def _token_logprobs(self, hidden: torch.Tensor, target_ids: torch.Tensor, chunk_size: int,
                        with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        if hidden.dim() != 2 or target_ids.shape != hidden.shape[:1]:
            raise ValueError(
                f"hidden must be [T, hidden_size] and target_ids [T], got {tuple(hidden.shape)} "
                f"and {tuple(target_ids.shape)}")
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        target_ids = target_ids.long()  # gather wants int64; batches may carry int32 ids
        return _TokenLogprobs.apply(hidden, self.lm_head.weight, target_ids, self, chunk_size, with_entropy)


class _TokenLogprobs(torch.autograd.Function):
    """``model.log_softmax(model.logits(hidden))`` at the targets (and, if asked, the entropy),
    ``chunk_size`` tokens at a time; no ``[T, vocab]`` tensor outlives its chunk.

    Each chunk's log-probabilities, logsumexp and entropy are ``model.log_softmax.at_targets``'
    (a conversion may swap in other kernels). ``weight`` is ``model.lm_head.weight``, the matrix
    ``model.logits`` multiplies by: it is an input so that autograd hands its gradient to the
    parameter (the embedding too, when tied).

    Forward keeps each token's logsumexp, so backward recomputes a chunk's logits with one matmul
    and gets the softmax from them with one exp (``model.log_softmax.grad_logits``), instead of
    replaying the log_softmax and the entropy and differentiating through them:
    ``d logp[y] / d logits = onehot(y) - softmax(logits)``, ``softmax = exp(logits - logsumexp)``.
    The entropy is a metric: not differentiable, so backward never touches it.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, model, chunk_size, with_entropy):
        logprobs, logsumexp, entropy = [], [], []
        for start in range(0, max(hidden.shape[0], 1), chunk_size):  # one empty chunk when T == 0
            rows = slice(start, start + chunk_size)
            chunk_logprobs, chunk_logsumexp, chunk_entropy = model.log_softmax.at_targets(
                model.logits(hidden[rows]), targets[rows], with_entropy)
            logprobs.append(chunk_logprobs)
            logsumexp.append(chunk_logsumexp)
            entropy.append(chunk_entropy)
        ctx.save_for_backward(hidden, weight, targets, torch.cat(logsumexp))
        ctx.model, ctx.chunk_size = model, chunk_size
        if not with_entropy:
            return torch.cat(logprobs), None
        entropy = torch.cat(entropy)
        ctx.mark_non_differentiable(entropy)
        return torch.cat(logprobs), entropy

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):
        hidden, weight, targets, logsumexp = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            chunk_hidden = hidden[rows]
            # The default matmul, also in true on-policy mode: the gradient needs the forward's
            # logits only up to rounding, and cuBLAS is faster than the batch-invariant kernel.
            grad_logits = ctx.model.log_softmax.grad_logits(
                F.linear(chunk_hidden, weight), logsumexp[rows], targets[rows], grad_logprobs[rows])
            if grad_hidden is not None:
                grad_hidden[rows] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.t(), chunk_hidden)
        return grad_hidden, grad_weight, None, None, None, None
