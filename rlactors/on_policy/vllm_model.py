"""True on-policy with vLLM: our model inside vLLM, and the trainer's copies of vLLM's two kernels.

vLLM runs ``VLLMCausalLM``, our decoder (``rlactors.models``) converted to batch-invariant modules
(``rlactors.on_policy.modules``) and registered as an out-of-tree architecture: vLLM supplies the
scheduler, the paged KV cache, CUDA graphs and sampling, while every op that shapes a logprob is
the op the trainer runs forward, except two that vLLM owns and the trainer calls as vLLM does:
attention in vLLM's KV cache through FlashAttention with one split (``PagedFlashAttention`` lays
each packed document out in pages like vLLM's cache), and the sampled token's logprob
(``compute_token_logprobs``, the trainer's ``VLLMLogSoftmax``). A mixture of experts runs our
``SparseMoeBlock`` with the batch-invariant kernels, all experts in one launch
(``InvariantExperts``) so CUDA graphs hold the layer. Nothing in vLLM is patched: the engine
registers the architecture and sets ``TRUE_ON_POLICY_ENGINE_ARGS``. vLLM names come through
``rlactors.vllm_api``, lazily: this module imports on CPU-only machines. Why each choice holds:
docs/true_on_policy.md and docs/ARCHITECTURE.md, "True on-policy".
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from rlactors.attention.varlen import cu_seqlens_from_positions
from rlactors.models.args import ModelArgs
from rlactors.models.checkpoint import expert_tensor_names
from rlactors.models.decoder import DecoderForCausalLM
from rlactors.models.moe import SparseMoeBlock
from rlactors.on_policy.modules import InvariantLogSoftmax, stack_weights, to_batch_invariant

ARCHITECTURE = "RLActorsForCausalLM"
PAGE_SIZE = 16  # vLLM's KV-cache block size in true on-policy mode; the trainer pages its keys alike
PADDED_HEAD_DIM = 128


def attention_head_dim(head_dim: int) -> int:
    """The head dim FlashAttention runs at in true on-policy mode, on both sides.

    FlashAttention 3 folds keys in blocks whose size it picks by head dim; at head dims up to 64
    the block is 128 keys for causal calls and 160 for calls without the causal mask, which is
    how it runs a step whose queries are all single decode tokens. A token decoded in such a step
    then has other bits than the same token in a prefill (measured at head dim 32:
    benchmarks/results/notes/gpu_probes.md). Above 64 dims, with a paged cache, the block does not
    depend on the mask. So smaller heads run zero-padded to ``PADDED_HEAD_DIM``: the zeros add
    nothing to a score, and the padded output columns are dropped.
    """
    return head_dim if head_dim > 64 else PADDED_HEAD_DIM


def pad_heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``x[T, H, D]`` zero-padded to ``head_dim`` in its last dim (itself when already that wide)."""
    return x if x.shape[-1] == head_dim else torch.nn.functional.pad(x, (0, head_dim - x.shape[-1]))


def register() -> None:
    """Makes ``ARCHITECTURE`` a vLLM model architecture (idempotent)."""
    from rlactors.vllm_api import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, VLLMCausalLM)


def true_on_policy_environment() -> dict[str, str]:
    """Environment vLLM must see before it is imported: FlashAttention with one split and no
    ahead-of-time schedule (batch-invariant mode), and the V2 model runner, whose sampled-token
    logprob is the per-row kernel the trainer calls."""
    return {"VLLM_BATCH_INVARIANT": "1", "VLLM_USE_V2_MODEL_RUNNER": "1"}


def share_replica_nccl_settings() -> None:
    """Sets, in this process, the environment vLLM's batch-invariant mode sets in a true on-policy
    replica's process, NCCL's protocol, algorithm and channel count among it. The trainer shares
    the weight group's communicator with the replicas, NCCL reads those settings once per process,
    and members with different ones hang at the first broadcast. Call before this process's first
    NCCL communicator."""
    from rlactors.vllm_api import override_envs_for_invariance

    override_envs_for_invariance()


# EngineArgs fields of a true on-policy vLLM replica (beside model, sizes and dtype).
TRUE_ON_POLICY_ENGINE_ARGS: dict[str, Any] = {
    "hf_overrides": {"architectures": [ARCHITECTURE]},
    # No torch.compile: Inductor would fuse our ops and round differently from the trainer.
    # CUDA graphs capture the whole forward of decode steps (our kernels and vLLM's attention).
    "compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"},
    "attention_backend": "FLASH_ATTN",
    "block_size": PAGE_SIZE,
    # Cascade attention splits a shared prefix into its own pass: another summation order.
    "disable_cascade_attn": True,
}


def to_engine_modules(model: DecoderForCausalLM) -> None:
    """The plain decoder converted, in place, as a vLLM replica runs it: batch-invariant with
    frozen weights, q/k/v and gate/up each stacked into one matmul (``modules.project``)."""
    to_batch_invariant(model, weights_frozen=True)
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        stack_weights((attention.q_proj, attention.k_proj, attention.v_proj))
        if not isinstance(mlp, SparseMoeBlock):
            stack_weights((mlp.gate_proj, mlp.up_proj))


class VLLMCausalLM(DecoderForCausalLM):
    """Our decoder as a vLLM model: parameter names are the checkpoint's (HF) names, the ops are
    the batch-invariant ones, and attention goes through one vLLM ``Attention`` layer per decoder
    layer (the paged KV cache)."""

    def __init__(self, *, vllm_config: Any, prefix: str = ""):
        from rlactors.vllm_api import Attention

        args = ModelArgs.from_hf_config(vllm_config.model_config.hf_config.to_dict())
        super().__init__(args)
        to_engine_modules(self)
        # On the GPU from the start: a CUDA graph cannot capture the copy rope() would make.
        self.model.inv_freq = self.model.inv_freq.to(self.model.embed_tokens.weight.device)
        self.attention_head_dim = attention_head_dim(args.head_dim)
        self.paged_attention = nn.ModuleList(
            Attention(args.num_attention_heads, self.attention_head_dim, args.head_dim ** -0.5,
                      args.num_key_value_heads, cache_config=vllm_config.cache_config,
                      prefix=f"{prefix}model.layers.{i}.self_attn.attn")
            for i in range(args.num_hidden_layers))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors: Any = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(input_ids, positions, self._attend)

    def _attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        tokens, width = q.shape[0], self.attention_head_dim
        q, k, v = (pad_heads(t, width).reshape(tokens, -1) for t in (q, k, v))
        out = self.paged_attention[layer_idx](q, k, v)
        return out.view(tokens, -1, width)[..., :self.args.head_dim]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden_states)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads tensors under the model's names, or, for experts, a checkpoint's per-expert
        tensors (each into its rows of the fused parameter); returns the parameters loaded."""
        params = dict(self.named_parameters())
        expert_rows = {}  # a checkpoint's per-expert tensor -> (fused parameter, its rows)
        for fused, experts in expert_tensor_names(self.args).items():
            for e, parts in enumerate(experts):
                for part, rows in zip(parts, params[fused].data[e].chunk(len(parts))):
                    expert_rows[part] = (fused, rows)
        loaded = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self.args.tie_word_embeddings:
                continue
            if name in expert_rows:
                name, target = expert_rows[name]
            elif name in params:
                target = params[name]
            else:
                raise ValueError(f"{name}: not a parameter of {ARCHITECTURE}")
            target.copy_(tensor)
            loaded.add(name)
        return loaded


# -- the trainer's side ----------------------------------------------------------------------------


def vllm_token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """fp32 ``log p(targets[t])`` under ``logits[t]``: vLLM's own per-row kernel, as its sampler
    computes the logprob of a sampled token."""
    from rlactors.vllm_api import compute_token_logprobs

    return compute_token_logprobs(logits, targets[:, None])[:, 0]


class VLLMLogSoftmax(InvariantLogSoftmax):
    """The trainer's log-probabilities when vLLM generates: a target's from vLLM's own kernel
    (``vllm_token_logprobs``), the full ones (for the entropy) batch-invariant."""

    def target_logprobs(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, None]:
        return vllm_token_logprobs(logits, targets), None


class PagedFlashAttention:
    """The trainer's ``attention(layer_idx, q, k, v)`` over packed documents, computed forward as a
    vLLM replica computes it: each document's keys and values are written to pages of
    ``PAGE_SIZE`` in vLLM's cache layout (``[pages, kv heads, PAGE_SIZE, 2 * head_dim]``, keys then
    values in the last dim), and every query attends through vLLM's FlashAttention call with the
    arguments its backend passes in batch-invariant mode. Backward is FlashAttention's, from that
    forward's output and logsumexp (``_PagedFlashAttentionFunction``).
    """

    def __init__(self, cu_seqlens: torch.Tensor, max_seqlen: int):
        device = cu_seqlens.device
        self.cu_seqlens = cu_seqlens.to(torch.int32)
        self.lengths = self.cu_seqlens.diff()
        self.max_seqlen = max_seqlen
        pages = (self.lengths + PAGE_SIZE - 1) // PAGE_SIZE
        first_page = pages.cumsum(0) - pages
        self.num_pages = int(pages.sum())
        width = int(pages.max())
        block_table = first_page[:, None] + torch.arange(width, device=device)
        # Past a document's end: its last page again (never read; the table must hold valid pages).
        self.block_table = torch.minimum(block_table, (first_page + pages - 1)[:, None]).to(torch.int32)
        # Token t of document d goes to page first_page[d] + p // PAGE_SIZE, row p % PAGE_SIZE (p: its position).
        starts = self.cu_seqlens[:-1].long()
        document = torch.repeat_interleave(torch.arange(self.lengths.numel(), device=device), self.lengths.long())
        position = torch.arange(int(self.cu_seqlens[-1]), device=device) - starts[document]
        self.page = first_page[document] + position // PAGE_SIZE
        self.row = position % PAGE_SIZE
        # Queries: every token of each document (vLLM's steps query a document's last tokens).
        self.cu_seqlens_q, self.max_seqlen_q = self.cu_seqlens, max_seqlen

    @classmethod
    def from_positions(cls, positions: torch.Tensor) -> PagedFlashAttention:
        cu_seqlens = cu_seqlens_from_positions(positions)
        return cls(cu_seqlens, int(cu_seqlens.diff().max().item()))

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _PagedFlashAttentionFunction.apply(q, k, v, self)

    def forward_values(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``[T, Hq, D]``: what vLLM computes for these queries (no autograd)."""
        return self.forward_values_and_lse(q, k, v)[0]

    def forward_values_and_lse(self, q: torch.Tensor, k: torch.Tensor,
                               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward_values``, and the fp32 logsumexp of each query's scaled scores ``[Hq, T]``."""
        from rlactors.vllm_api import flash_attn_varlen_func, get_flash_attn_version

        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        width = attention_head_dim(head_dim)
        q, k, v = (pad_heads(t, width) for t in (q, k, v))
        cache = torch.zeros(self.num_pages, num_kv_heads, PAGE_SIZE, 2 * width, dtype=k.dtype, device=k.device)
        cache[self.page, :, self.row] = torch.cat((k, v), dim=-1)
        key_cache, value_cache = cache.transpose(1, 2).split(width, dim=-1)  # as vLLM's backend views it
        out = torch.empty_like(q)
        scale = torch.ones((), dtype=torch.float32, device=q.device).expand(self.lengths.numel(), num_kv_heads)
        _, lse = flash_attn_varlen_func(
            q=q, k=key_cache, v=value_cache, out=out, cu_seqlens_q=self.cu_seqlens_q, max_seqlen_q=self.max_seqlen_q,
            seqused_k=self.lengths, max_seqlen_k=self.max_seqlen, softmax_scale=head_dim ** -0.5, causal=True,
            alibi_slopes=None, window_size=[-1, -1], block_table=self.block_table, softcap=0.0,
            scheduler_metadata=None, fa_version=get_flash_attn_version(head_size=width),
            q_descale=scale, k_descale=scale, v_descale=scale, num_splits=1, return_softmax_lse=True)
        return out[..., :head_dim], lse


class _PagedFlashAttentionFunction(torch.autograd.Function):
    """``PagedFlashAttention``'s values forward; backward is FlashAttention's (torch's kernel, as
    the default trainer's attention runs it) from that forward's output and logsumexp, which give
    the gradient of the default attention without running it again."""

    @staticmethod
    def forward(ctx, q, k, v, attention: PagedFlashAttention):
        out, lse = attention.forward_values_and_lse(q, k, v)
        out = out.contiguous()  # unpadded heads: FlashAttention's backward wants its own layout
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.attention = attention
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        attention = ctx.attention
        grads = torch.ops.aten._flash_attention_backward(
            grad.contiguous(), q, k, v, out, lse, attention.cu_seqlens_q, attention.cu_seqlens,
            attention.max_seqlen_q, attention.max_seqlen, 0.0, True,
            torch.empty(2, dtype=torch.uint64, device=q.device), torch.empty(0, device=q.device),
            scale=q.shape[-1] ** -0.5)
        return (*grads, None)
