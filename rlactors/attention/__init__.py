"""Attention, in one package. Every model calls ``attention(layer_idx, q, k, v)``, an object the
caller chooses:

- ``varlen``: the trainer's default, packed documents causal inside each (flash-attn varlen,
  torch varlen_attn or SDPA), and ``cu_seqlens_from_positions``.
- ``invariant``: batch-invariant attention (``attend``, ``AttentionPlan``) and the trainer's
  ``BatchInvariantAttention``, for true on-policy with the native engine; ``invariant_triton`` is
  its CUDA kernel.
- ``paged``: the native engine's attention over its paged KV cache (``paged_attention``).

The trainer's copy of a vLLM replica's attention lives with the rest of true on-policy with vLLM,
in ``rlactors.engines.vllm_model``.
"""
