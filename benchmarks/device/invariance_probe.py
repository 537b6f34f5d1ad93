"""Which kernel of the vLLM true on-policy path changes a row's bits with the batch, at given model
shapes (GPU, vLLM installed): the batch-invariant linear and RMSNorm, vLLM's FlashAttention as the
trainer calls it (a document's whole prefill vs each query alone, decode-style, vs half the
document after the other half: chunked prefill), and vLLM's sampled-token logprob kernel.

    python benchmarks/device/invariance_probe.py

Prints one line per check; asserts nothing.
"""

from __future__ import annotations

import torch

from rlactors.engines.vllm_model import PagedFlashAttention, vllm_token_logprobs
from rlactors.models import batch_invariant as bi

BATCHES = [(0, 1), (5, 1), (0, 3), (2, 7), (0, 16), (3, 37), (0, 100), (1, 199), (0, 256), (0, 512)]
MODELS = {  # hidden, intermediate, heads, kv heads, head_dim, vocab
    "demo": (128, 384, 4, 2, 32, 1024),
    "0.6b": (1024, 3072, 16, 8, 128, 151936),
}


def rows_differ(fn, rows: int) -> list[tuple[int, int]]:
    """The (offset, count) batches whose `fn(slice)` rows differ from those of `fn` on all `rows`."""
    full = fn(slice(0, rows))
    return [(o, n) for o, n in BATCHES if o + n <= rows and not torch.equal(fn(slice(o, o + n)), full[o:o + n])]


def attention_checks(heads: int, kv_heads: int, head_dim: int, length: int = 300) -> dict[str, int]:
    """Rows of one document's attention that differ: whole prefill vs one query at a time (keys
    up to it, as a decode step sees them) and vs the second half after the first (chunked)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(length, heads, head_dim, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(length, kv_heads, head_dim, device="cuda", generator=g).bfloat16() for _ in range(2))
    full = PagedFlashAttention.from_positions(torch.arange(length, device="cuda")).forward_values(q, k, v)
    decode = 0
    for t in range(0, length, 7):
        alone = DecodeAttention(t).forward_values(q[t:t + 1], k[:t + 1], v[:t + 1])
        decode += int(not torch.equal(alone[0], full[t]))
    half = length // 2
    second = DecodeAttention(half, length - half).forward_values(q[half:], k, v)
    return {"decode rows differing": decode, "chunked rows differing":
            int((second != full[half:]).flatten(1).any(-1).sum())}


class DecodeAttention(PagedFlashAttention):
    """`queries` queries at positions `start`.. of one document whose keys are positions 0..start+queries-1."""

    def __init__(self, start: int, queries: int = 1):
        keys = start + queries
        super().__init__(torch.tensor([0, keys], device="cuda", dtype=torch.int32), keys)
        self.cu_seqlens_q = torch.tensor([0, queries], device="cuda", dtype=torch.int32)
        self.max_seqlen_q = queries

    def forward_values(self, q, k, v):
        from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func, get_flash_attn_version

        from rlactors.engines.vllm_model import PAGE_SIZE

        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        cache = torch.zeros(self.num_pages, num_kv_heads, PAGE_SIZE, 2 * head_dim, dtype=k.dtype, device=k.device)
        cache[self.page, :, self.row] = torch.cat((k, v), dim=-1)
        key_cache, value_cache = cache.transpose(1, 2).split(head_dim, dim=-1)
        out = torch.empty_like(q)
        scale = torch.ones((), dtype=torch.float32, device=q.device).expand(1, num_kv_heads)
        flash_attn_varlen_func(
            q=q, k=key_cache, v=value_cache, out=out, cu_seqlens_q=self.cu_seqlens_q, max_seqlen_q=self.max_seqlen_q,
            seqused_k=self.lengths, max_seqlen_k=self.max_seqlen, softmax_scale=head_dim ** -0.5, causal=True,
            alibi_slopes=None, window_size=[-1, -1], block_table=self.block_table, softcap=0.0,
            scheduler_metadata=None, fa_version=get_flash_attn_version(head_size=head_dim),
            q_descale=scale, k_descale=scale, v_descale=scale, num_splits=1)
        return out


def main() -> None:
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version

    torch.manual_seed(0)
    for name, (hidden, inter, heads, kv_heads, head_dim, vocab) in MODELS.items():
        print(f"== {name}: FlashAttention version {get_flash_attn_version(head_size=head_dim)}", flush=True)
        for k, n in ((hidden, heads * head_dim), (hidden, kv_heads * head_dim), (hidden, inter), (inter, hidden),
                     (heads * head_dim, hidden), (hidden, vocab)):
            w = torch.randn(n, k, device="cuda").bfloat16()
            x = torch.randn(600, k, device="cuda").bfloat16()
            differ = rows_differ(lambda r, x=x, w=w: bi.linear(x[r], w), 600)
            print(f"linear K={k} N={n}: batches differing {differ}", flush=True)
        for n in (hidden, head_dim):
            w = torch.randn(n, device="cuda").bfloat16()
            x = torch.randn(600, n, device="cuda").bfloat16()
            differ = rows_differ(lambda r, x=x, w=w: bi.rms_norm(x[r], w, 1e-6), 600)
            print(f"rms_norm N={n}: batches differing {differ}", flush=True)
        logits = (torch.randn(600, vocab, device="cuda") * 4).bfloat16()
        targets = torch.randint(0, vocab, (600,), device="cuda")
        print(f"token logprobs vocab={vocab}: batches differing "
              f"{rows_differ(lambda r, x=logits, t=targets: vllm_token_logprobs(x[r], t[r]), 600)}", flush=True)
        print(f"attention heads={heads}/{kv_heads} head_dim={head_dim}: {attention_checks(heads, kv_heads, head_dim)}",
              flush=True)


if __name__ == "__main__":
    main()
