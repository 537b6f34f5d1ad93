"""Packed variable-length causal attention.

A packed batch is one sequence of ``T`` tokens holding several documents end to end; a new
document starts wherever ``positions == 0``. Attention is causal inside a document and never
crosses into another one. Three backends compute the same thing:

- ``flash``: ``flash_attn.flash_attn_varlen_func`` (CUDA, when flash-attn is installed);
- ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` (CUDA, torch >= 2.10);
- ``sdpa``: ``scaled_dot_product_attention`` over the documents padded into a batch (any device).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import math

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "flash", "varlen", "sdpa")


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def resolve_backend(backend: str, device: torch.device) -> str:
    """Maps ``auto`` to the fastest backend usable on ``device``; rejects unusable choices."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    on_cuda = device.type == "cuda"
    if backend == "auto":
        if on_cuda:
            return "flash" if flash_attn_available() else "varlen"
        return "sdpa"
    if backend in ("flash", "varlen") and not on_cuda:
        raise ValueError(f"attention backend {backend!r} needs CUDA tensors, got device {device}")
    if backend == "flash" and not flash_attn_available():
        raise ValueError("attention backend 'flash' needs the flash-attn package, which is not installed")
    return backend


def cu_seqlens_from_positions(positions: torch.Tensor) -> torch.Tensor:
    """Document boundaries ``[0, end_1, ..., T]`` (int32) of a packed ``positions[T]`` tensor.

    Raises ValueError unless positions count 0, 1, 2, ... inside every document.
    """
    if positions.dim() != 1 or positions.numel() == 0:
        raise ValueError(f"positions must be a non-empty 1-D tensor, got shape {tuple(positions.shape)}")
    total = positions.numel()
    starts = torch.nonzero(positions == 0).flatten()
    if starts.numel() == 0 or starts[0].item() != 0:
        raise ValueError("positions must start at 0 (each document starts with position 0)")
    cu_seqlens = torch.cat([starts, starts.new_tensor([total])]).to(torch.int32)
    lengths = cu_seqlens.diff()
    expected = torch.arange(total, device=positions.device) - torch.repeat_interleave(starts, lengths)
    if not torch.equal(positions.long(), expected):
        raise ValueError("positions must count up by 1 inside each document and restart at 0")
    return cu_seqlens


class VarlenAttention:
    """The ``attention(layer_idx, q, k, v)`` callable for packed training forwards.

    q is ``[T, Hq, D]``; k and v are ``[T, Hkv, D]`` with ``Hq % Hkv == 0`` (GQA);
    the result is ``[T, Hq, D]``. Scale is ``1/sqrt(D)``. The same instance serves every layer.
    """

    def __init__(self, cu_seqlens: torch.Tensor, max_seqlen: int, backend: str = "auto"):
        self.cu_seqlens = cu_seqlens
        self.max_seqlen = max_seqlen
        self.total_tokens = int(cu_seqlens[-1])
        self.backend = resolve_backend(backend, cu_seqlens.device)

    @classmethod
    def from_positions(cls, positions: torch.Tensor, backend: str = "auto") -> VarlenAttention:
        cu_seqlens = cu_seqlens_from_positions(positions)
        return cls(cu_seqlens, int(cu_seqlens.diff().max().item()), backend)

    @property
    def num_documents(self) -> int:
        return self.cu_seqlens.numel() - 1

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.shape[0] != self.total_tokens or k.shape[0] != q.shape[0] or v.shape != k.shape:
            raise ValueError(
                f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match "
                f"the {self.total_tokens} packed tokens of this VarlenAttention")
        if self.backend == "flash":
            return self._flash(q, k, v)
        if self.backend == "varlen":
            return self._varlen(q, k, v)
        return self._sdpa(q, k, v)

    def _flash(self, q, k, v):
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func(
            q, k, v, self.cu_seqlens, self.cu_seqlens, self.max_seqlen, self.max_seqlen,
            softmax_scale=1.0 / math.sqrt(q.shape[-1]), causal=True)

    def _varlen(self, q, k, v):
        varlen_attn, has_gqa = _torch_varlen_attn()
        kwargs = {"scale": 1.0 / math.sqrt(q.shape[-1])}
        if has_gqa:
            kwargs["enable_gqa"] = q.shape[1] != k.shape[1]
        else:
            k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
        return varlen_attn(q, k, v, self.cu_seqlens, self.cu_seqlens, self.max_seqlen, self.max_seqlen,
                           **kwargs)

    def _sdpa(self, q, k, v):
        # Documents padded to one [N, H, max_seqlen, D] batch and a single causal SDPA call. Causal
        # masking alone is exact here: pads sit after each document's last token, so a real query
        # never sees them, and the pad rows' outputs are dropped. Work is N * max_seqlen^2 (not
        # T^2 as with a block-diagonal mask), and SDPA may use its flash kernels on GPU.
        doc, offset = self._padded_index

        def pad(x: torch.Tensor) -> torch.Tensor:
            padded = x.new_zeros(self.num_documents, self.max_seqlen, *x.shape[1:])
            padded[doc, offset] = x
            return padded.transpose(1, 2)

        out = F.scaled_dot_product_attention(
            pad(q), pad(k), pad(v), is_causal=True, scale=1.0 / math.sqrt(q.shape[-1]),
            enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(1, 2)[doc, offset]

    @functools.cached_property
    def _padded_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """For every packed token, its document and its offset inside that document."""
        device = self.cu_seqlens.device
        starts = self.cu_seqlens[:-1].long()
        doc = torch.repeat_interleave(torch.arange(self.num_documents, device=device), self.cu_seqlens.diff())
        return doc, torch.arange(self.total_tokens, device=device) - starts[doc]


def repeat_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``[T, Hkv, D] -> [T, num_heads, D]``: each kv head serves ``num_heads // Hkv`` query heads."""
    return x.repeat_interleave(num_heads // x.shape[1], dim=1)


@functools.cache
def _torch_varlen_attn():
    """torch's varlen_attn with causal masking bound, and whether it takes ``enable_gqa``.

    torch 2.10 spells causal ``is_causal=True``; 2.11+ spells it ``window_size=(-1, 0)``.
    torch 2.11 has no ``enable_gqa``, so kv heads are repeated there.
    """
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    return functools.partial(varlen_attn, **causal), "enable_gqa" in params
