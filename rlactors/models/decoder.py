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

``set_batch_invariant(True)`` (the true on-policy mode) routes every linear, RMSNorm, RoPE, the
MLP activation, the experts' routing and the fp32 log-softmax through
``rlactors.models.batch_invariant``, so that a token's logprob (and its experts) do not depend
on what else is in the batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from rlactors.attention.varlen import VarlenAttention
from rlactors.models import batch_invariant as bi
from rlactors.models.args import Llama3RopeScaling, ModelArgs
from rlactors.models.moe import SparseMoeBlock

# attention(layer_idx, q[T, Hq, D], k[T, Hkv, D], v[T, Hkv, D]) -> out[T, Hq, D]
Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    batch_invariant = False

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            return bi.rms_norm(x, self.weight, self.eps)
        return bi.torch_rms_norm(x, self.weight, self.eps)


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
    batch_invariant = False

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = args.num_attention_heads
        self.num_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        bias = args.family.qkv_bias
        self.q_proj = bi.Linear(args.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = bi.Linear(args.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = bi.Linear(args.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = bi.Linear(self.num_heads * self.head_dim, args.hidden_size)
        self.q_norm = self.k_norm = None
        if args.family.qk_norm:  # per head, before RoPE
            self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: Attention,
                residual: torch.Tensor) -> torch.Tensor:
        """``residual`` plus the attention's output (the o_proj adds it: one kernel on the engine's path)."""
        T = x.shape[0]
        q, k, v = bi.project(x, (self.q_proj, self.k_proj, self.v_proj))
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        rope = bi.rope if self.batch_invariant else bi.apply_rope
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        out = attention(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim), residual)


class MLP(nn.Module):
    batch_invariant = False

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = bi.Linear(args.hidden_size, args.intermediate_size)
        self.up_proj = bi.Linear(args.hidden_size, args.intermediate_size)
        self.down_proj = bi.Linear(args.intermediate_size, args.hidden_size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual`` plus the MLP's output (the down_proj adds it)."""
        if self.batch_invariant:
            return self.down_proj(bi.silu_mul(*bi.project(x, (self.gate_proj, self.up_proj))), residual)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x), residual)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.self_attn = SelfAttention(args, layer_idx)
        self.mlp = SparseMoeBlock(args) if args.is_sparse_layer(layer_idx) else MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention: Attention) -> torch.Tensor:
        x = self.self_attn(self.input_layernorm(x), cos, sin, attention, residual=x)
        return self.mlp(self.post_attention_layernorm(x), residual=x)


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


class DecoderForCausalLM(nn.Module):
    """A causal LM of ``args.model_type``'s family; module tree and parameter names match that
    family's HF model (``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM`` as transformers 5 holds it in
    memory, ``Qwen2ForCausalLM``, ``LlamaForCausalLM``).

    A freshly constructed model holds placeholder values (the embedding is left uninitialized):
    load weights with ``rlactors.models.checkpoint.from_pretrained`` (``rlactors.models.tiny``
    writes random ones). Construct under ``torch.device("meta")`` to allocate nothing.
    """

    batch_invariant = False
    # fp32 log p(targets[t]) from logits[t] when the generator computes it other than by
    # log_softmax and gather: a vLLM replica in true on-policy mode (rlactors.engines.vllm_model).
    token_logprob_kernel: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = DecoderModel(args)
        self.lm_head = bi.Linear(args.hidden_size, args.vocab_size)
        self.tie_weights()

    def tie_weights(self) -> None:
        """With tied embeddings, makes ``lm_head.weight`` the very tensor of ``embed_tokens``.

        Call again after anything that replaces parameters (``to_empty``, ``load_state_dict``
        with ``assign=True``).
        """
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def set_batch_invariant(self, enabled: bool = True, weights_frozen: bool = False) -> None:
        """Switches every op whose result could depend on the batch to its batch-invariant
        version (``rlactors.models.batch_invariant``); attention is the caller's to choose.
        ``weights_frozen``: the weights change only by in-place loads (an inference engine), so
        the linears may keep per-weight work between calls (``batch_invariant.Linear``)."""
        for module in self.modules():
            if hasattr(type(module), "batch_invariant"):
                module.batch_invariant = enabled
            if isinstance(module, bi.Linear):
                module.weights_frozen = weights_frozen

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

    def log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        """fp32 log-probabilities of ``logits [T, vocab]``: what the trainer and the engine use."""
        return bi.log_softmax(logits) if self.batch_invariant else logits.float().log_softmax(-1)

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

    ``weight`` is ``model.lm_head.weight``, the matrix ``model.logits`` multiplies by: it is an
    input so that autograd hands its gradient to the parameter (the embedding too, when tied).

    Forward keeps each token's logsumexp, so backward recomputes a chunk's logits with one matmul
    and gets the softmax from them with one exp, instead of replaying the log_softmax and the
    entropy and differentiating through them:
    ``d logp[y] / d logits = onehot(y) - softmax(logits)``, ``softmax = exp(logits - logsumexp)``.
    The entropy is a metric: not differentiable, so backward never touches it.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, model, chunk_size, with_entropy):
        logprobs, logsumexp, entropy = [], [], []
        for start in range(0, max(hidden.shape[0], 1), chunk_size):  # one empty chunk when T == 0
            rows = slice(start, start + chunk_size)
            logits = model.logits(hidden[rows])
            target = targets[rows, None]
            if model.token_logprob_kernel is None:
                chunk_logprobs = model.log_softmax(logits)
                target_logprobs = chunk_logprobs.gather(-1, target).squeeze(-1)
            else:
                target_logprobs = model.token_logprob_kernel(logits, target[:, 0])
                chunk_logprobs = model.log_softmax(logits) if with_entropy else None
            logprobs.append(target_logprobs)
            # log_softmax = logits - logsumexp, so the target's entries give the logsumexp at
            # O(T) cost, consistent with the log_softmax's own rounding (measured at Qwen3's
            # vocab: exp(logits - logsumexp) is within 4e-6 relative of exp(log_softmax)).
            logsumexp.append(logits.gather(-1, target).squeeze(-1) - target_logprobs)
            if with_entropy:
                entropy.append(-(chunk_logprobs.exp() * chunk_logprobs).sum(-1))
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
            chunk_hidden, grad = hidden[rows], grad_logprobs[rows, None]
            # The default matmul, also in true on-policy mode: the gradient needs the forward's
            # logits only up to rounding, and cuBLAS is faster than the batch-invariant kernel.
            logits = F.linear(chunk_hidden, weight)
            probs = (logits - logsumexp[rows, None]).exp_()  # fp32, like the log-probs
            probs.scatter_add_(-1, targets[rows, None], torch.full_like(grad, -1.0))  # p - onehot(y)
            # grad * (onehot(y) - p), rounded once into the logits' dtype as autograd through the
            # log_softmax's .float() would; it overwrites the logits, which are done with.
            grad_logits = torch.mul(probs, -grad, out=logits)
            if grad_hidden is not None:
                grad_hidden[rows] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.t(), chunk_hidden)
        return grad_hidden, grad_weight, None, None, None, None
