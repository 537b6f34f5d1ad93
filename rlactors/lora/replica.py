"""LoRA in a vLLM replica: it holds the frozen base, receives the adapters alone and merges them
into the rows of its model's parameters that hold each adapted linear's weight.

Each adapted linear's weight is found under its HF name, or as its rows of a fused parameter
(vLLM's ``qkv_proj`` and ``gate_up_proj``, by the model's ``packed_modules_mapping`` and the fused
layer's ``output_sizes``); one GPU per replica (``generator.tp = 1``), so the rows are the whole
weight. At the first load a copy of those rows is kept as the base, and every load writes
``merged_weight(base, A, B, alpha / r)`` into them in place: each adapter version merges from the
base, never from the previous merge, and views of the parameters (a stacked weight, CUDA graphs,
vLLM's sleep mode, which keeps their addresses) see it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from rlactors.lora.adapters import ADAPTER_NAMES, merged_weight

MERGE_ATTRIBUTE = "rlactors_lora_merge"  # where a model keeps its AdapterMerge between loads


def is_adapter(name: str) -> bool:
    return any(f".{a}." in name for a in ADAPTER_NAMES)


def weight_rows(model: torch.nn.Module, params: dict[str, torch.nn.Parameter], linear: str) -> torch.Tensor:
    """The tensor (a view) holding the weight of the HF linear `linear`
    (``model.layers.0.self_attn.q_proj``) in `model`, whose `named_parameters` are `params`;
    ValueError if the model has none."""
    if f"{linear}.weight" in params:
        return params[f"{linear}.weight"].data
    parent, _, leaf = linear.rpartition(".")
    for fused, parts in (getattr(model, "packed_modules_mapping", None) or {}).items():
        if leaf in parts and f"{parent}.{fused}.weight" in params:
            sizes = getattr(model.get_submodule(f"{parent}.{fused}"), "output_sizes", None)
            weight = params[f"{parent}.{fused}.weight"].data
            if sizes is None or len(sizes) != len(parts) or sum(sizes) != weight.shape[0]:
                raise ValueError(f"{linear}: the rows of {parent}.{fused} cannot be told apart "
                                 f"(output_sizes {sizes}, {weight.shape[0]} rows)")
            i = parts.index(leaf)
            return weight[sum(sizes[:i]):sum(sizes[:i + 1])]
    raise ValueError(f"{linear}: no parameter of the model holds its weight")


class AdapterMerge:
    """The adapted linears of one model: where each one's weight lives and its frozen base."""

    def __init__(self, model: torch.nn.Module, linears: Iterable[str]):
        params = dict(model.named_parameters())
        self.targets = {name: weight_rows(model, params, name) for name in linears}
        self.bases = {name: rows.clone() for name, rows in self.targets.items()}

    @torch.no_grad()
    def apply(self, adapters: Mapping[str, torch.Tensor], scale: float) -> None:
        """Writes ``merged_weight`` of each base and its adapters in `adapters` (``<linear>.lora_A.weight``,
        ``<linear>.lora_B.weight``) into the model. ValueError, before writing anything, when
        `adapters` does not name exactly this model's adapters with matching shapes."""
        expected = {f"{n}.{a}.weight" for n in self.targets for a in ADAPTER_NAMES}
        if set(adapters) != expected:
            raise ValueError(f"adapters do not match the model's: missing {sorted(expected - set(adapters))[:3]}, "
                             f"unknown {sorted(set(adapters) - expected)[:3]}")
        for name, target in self.targets.items():
            a, b = adapters[f"{name}.lora_A.weight"], adapters[f"{name}.lora_B.weight"]
            if a.shape[1] != target.shape[1] or b.shape[0] != target.shape[0] or a.shape[0] != b.shape[1]:
                raise ValueError(f"{name}: adapters A {tuple(a.shape)}, B {tuple(b.shape)} do not fit its weight "
                                 f"{tuple(target.shape)}")
        for name, target in self.targets.items():
            device = target.device
            target.copy_(merged_weight(self.bases[name], adapters[f"{name}.lora_A.weight"].to(device),
                                       adapters[f"{name}.lora_B.weight"].to(device), scale))


def load_adapters(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]], scale: float) -> None:
    """Merges received adapters into `model` (a vLLM worker's model), from its base. The first
    call keeps the base: the model must then hold it (as it does from its checkpoint)."""
    adapters = dict(named_tensors)
    merge = getattr(model, MERGE_ATTRIBUTE, None)
    if merge is None:
        merge = AdapterMerge(model, sorted({n.rsplit(".", 2)[0] for n in adapters if is_adapter(n)}))
        setattr(model, MERGE_ATTRIBUTE, merge)
    merge.apply(adapters, scale)
