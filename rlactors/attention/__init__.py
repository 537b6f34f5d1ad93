"""Attention for packed training batches. Every model calls ``attention(layer_idx, q, k, v)``, an
object the caller chooses; ``varlen`` holds the trainer's default (packed documents causal inside
each: flash-attn varlen, torch varlen_attn or SDPA) and ``cu_seqlens_from_positions``.

The native engine's attention over its KV cache is in ``rlactors.engines.paged_attention``; the
true on-policy attentions (batch-invariant, and the trainer's copy of vLLM's) in
``rlactors.on_policy``.
"""
