"""Loading a received weight buffer into a vLLM model by plain copies, once proven equal to load_weights.

vLLM's `load_weights` walks every HF tensor through Python weight loaders, which fuse q/k/v into
qkv_proj and gate/up into gate_up_proj: tens of milliseconds per sync for a 1.7B model. In an
unsharded (TP=1) model those loaders only copy: each parameter is one HF tensor, or several
stacked on dim 0 as the model's `packed_modules_mapping` names them, or, for a mixture of experts,
one of the trainer's fused expert tensors (`FUSED_EXPERTS`). `CopyPlan.derive` builds
that map from names and shapes, and keeps it only if the parameters `load_weights` just filled
from the same buffer equal it bit for bit. Any parameter it cannot place (a sharded TP worker, a
padded vocabulary, a weight the loader transforms) means no plan, and the replica keeps using
`load_weights`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from rlactors.weight_sync.packed import PackedLayout

# vLLM's FusedMoE holds a layer's experts in the layout rlactors' trainer sends them in
# (rlactors.models.moe.Experts): w13_weight [E, 2I, H] (each expert's gate rows, then its up rows)
# is gate_up_proj, w2_weight [E, H, I] is down_proj.
FUSED_EXPERTS = {"experts.routed_experts.w13_weight": "experts.gate_up_proj",
                 "experts.routed_experts.w2_weight": "experts.down_proj"}


def _sources(param_name: str, available: Mapping[str, torch.Tensor],
             packed: Mapping[str, list[str]]) -> list[str] | None:
    """The HF tensors a model parameter is made of, in stacking order, or None."""
    if param_name in available:
        return [param_name]
    for vllm_name, ours in FUSED_EXPERTS.items():
        if param_name.endswith(f".{vllm_name}"):
            name = param_name.removesuffix(vllm_name) + ours
            return [name] if name in available else None
    parts = param_name.split(".")
    for i, part in enumerate(parts):
        if part in packed:
            names = [".".join(parts[:i] + [sub] + parts[i + 1:]) for sub in packed[part]]
            return names if all(n in available for n in names) else None
    return None


@dataclass
class CopyPlan:
    """Slices of the model's parameters and the buffer views copied into them."""

    targets: list[torch.Tensor]
    sources: list[torch.Tensor]

    @classmethod
    def derive(cls, model: torch.nn.Module, layout: PackedLayout, buffer: torch.Tensor) -> CopyPlan | None:
        """The plan for `model` and the persistent receive `buffer`, or None. Call right after
        `model.load_weights(layout.views(buffer))`: the plan is kept only if it reproduces that."""
        views = dict(layout.views(buffer))
        packed = getattr(model, "packed_modules_mapping", {}) or {}
        targets, sources, used = [], [], set()
        for name, param in model.named_parameters():
            names = _sources(name, views, packed)
            if names is None:
                return None
            parts = [views[n] for n in names]
            rows = sum(p.shape[0] for p in parts)
            if any(p.shape[1:] != param.shape[1:] or p.dtype != param.dtype for p in parts) or rows != param.shape[0]:
                return None
            first = 0
            for part in parts:
                targets.append(param.data[first:first + part.shape[0]])
                sources.append(part)
                first += part.shape[0]
            used.update(names)
        if used != set(views):
            return None
        if not all(torch.equal(t, s) for t, s in zip(targets, sources)):
            return None
        return cls(targets, sources)

    def apply(self) -> None:
        """Copies the buffer's current contents into the model's parameters."""
        torch._foreach_copy_(self.targets, self.sources)
