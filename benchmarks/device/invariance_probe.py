"""Which kernel of the vLLM true on-policy path changes a row's bits with the batch, at given model
shapes (GPU, vLLM installed): the batch-invariant linear and RMSNorm, vLLM's FlashAttention as the
trainer calls it, heads padded as in true on-policy mode and not (a document's whole prefill vs
each query alone, decode-style, vs half the document after the other half: chunked prefill), and
vLLM's sampled-token logprob kernel.

    python benchmarks/device/invariance_probe.py

Prints one line per check; asserts nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from support.vllm_checks import attention_of_last_queries  # noqa: E402

from rlactors.on_policy import ops as bi  # noqa: E402
from rlactors.on_policy import vllm_model  # noqa: E402
from rlactors.on_policy.vllm_model import PagedFlashAttention, vllm_token_logprobs  # noqa: E402

BATCHES = [(0, 1), (5, 1), (0, 3), (2, 7), (0, 16), (3, 37), (0, 100), (1, 199), (0, 256), (0, 512)]
MODELS = {  # hidden, intermediate, heads, kv heads, head_dim, vocab
    "demo": (128, 384, 4, 2, 32, 1024),
    "0.6b": (1024, 3072, 16, 8, 128, 151936),
    "llama-3.2-1b": (2048, 8192, 32, 8, 64, 128256),
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
        alone = attention_of_last_queries(t + 1, 1).forward_values(q[t:t + 1], k[:t + 1], v[:t + 1])
        decode += int(not torch.equal(alone[0], full[t]))
    half = length // 2
    second = attention_of_last_queries(length, length - half).forward_values(q[half:], k, v)
    return {"decode rows differing": decode, "chunked rows differing":
            int((second != full[half:]).flatten(1).any(-1).sum())}


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
        checks = attention_checks(heads, kv_heads, head_dim)
        with mock.patch.object(vllm_model, "attention_head_dim", lambda d: d):
            unpadded = attention_checks(heads, kv_heads, head_dim)
        print(f"attention heads={heads}/{kv_heads} head_dim={head_dim}: as run (padded to "
              f"{vllm_model.attention_head_dim(head_dim)}) {checks}; unpadded {unpadded}", flush=True)


if __name__ == "__main__":
    main()
