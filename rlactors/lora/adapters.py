"""LoRA as conversions of the plain decoder: each targeted linear ``y = x W^T`` gains two adapter
linears, ``lora_A [r, in]`` and ``lora_B [out, r]``, and computes ``x (W + s B A)^T`` with
``s = alpha / r``. Their parameters are named as PEFT names them after its prefix
(``model.layers.0.self_attn.q_proj.lora_A.weight``); the base keeps its HF names.

- The trainer (``to_lora``): the base is frozen, in the compute dtype, and the adapters are the
  only trainable parameters (fp32 masters). A plain linear adds ``s * B(A(dropout(x)))`` to its
  output (PEFT's ops, in PEFT's order); a batch-invariant one (true on-policy) multiplies by
  ``merged_weight``, so its forward is the generator's bit for bit.
- The native engine (``attach_adapters``): the linears keep their class; each keeps a copy of its
  base weight, and ``merge_adapters_`` writes ``merged_weight`` into ``weight`` after the adapters
  load. Decoding then costs what it costs without LoRA.

``merged_weight`` is the one place the merge is computed, on both sides and in exports.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from rlactors.config import LoraConfig
from rlactors.models.args import ModelArgs
from rlactors.models.decoder import DecoderForCausalLM
from rlactors.models.moe import SparseMoeBlock
from rlactors.on_policy import ops
from rlactors.on_policy.modules import InvariantLinear

ADAPTER_NAMES = ("lora_A", "lora_B")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
_SEED = 0  # of the lora_A init: every trainer rank and every replica makes the same one


def merged_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """``W + scale * B A`` in ``W``'s dtype; differentiable in the adapters.

    The adapters are first rounded to ``W``'s dtype (what the generators receive), ``B A`` is the
    batch-invariant matmul in fp32 (``ops.linear``: every element one fixed-order sum over the
    rank, on any device and shape), added to ``W`` in fp32 and rounded once. Whoever holds the
    same three tensors gets the same bits.
    """
    a = lora_a.to(weight.dtype).float()
    b = lora_b.to(weight.dtype).float()
    delta = ops.linear(b, a.t().contiguous())  # b @ a: [out, in]
    return (weight.float() + scale * delta).to(weight.dtype)


def scale(config: LoraConfig) -> float:
    return config.alpha / config.rank


def targeted(model: nn.Module, config: LoraConfig) -> list[tuple[str, nn.Linear]]:
    """``(name, linear)`` of every decoder-layer linear ``config.target_modules`` names; raises
    ValueError naming a target that matches none of this model's linears, or an MLP target on a
    mixture-of-experts model (PEFT reads those as the experts, which are not adapted here)."""
    if any(isinstance(m, SparseMoeBlock) for m in model.modules()):
        mlp = [t for t in config.target_modules if t in MLP_TARGETS]
        if mlp:
            raise ValueError(f"model.lora.target_modules: {mlp} on a mixture-of-experts model: experts "
                             "cannot be targeted; target the attention (q_proj, k_proj, v_proj, o_proj)")
    found = [(name, m) for name, m in model.named_modules()
             if isinstance(m, nn.Linear) and ".layers." in f".{name}"
             and name.rsplit(".", 1)[-1] in config.target_modules]
    have = {name.rsplit(".", 1)[-1] for name, _ in found}
    missing = [t for t in config.target_modules if t not in have]
    if missing:
        linears = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                          if isinstance(m, nn.Linear) and ".layers." in f".{n}"})
        raise ValueError(f"model.lora.target_modules: {missing} match no linear of this model "
                         f"(its layers' linears: {linears}; experts cannot be targeted)")
    return found


def adapter_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The adapters' parameters by name (none without LoRA)."""
    return {name: p for name, p in model.named_parameters()
            if any(f".{a}." in name for a in ADAPTER_NAMES)}


def initial_adapters(model: nn.Module, config: LoraConfig) -> dict[str, torch.Tensor]:
    """The adapters' first values, fp32 on CPU, by name: ``config.init_from``'s (a PEFT adapter
    dir), else ``lora_A`` as ``nn.Linear`` initialises a weight (PEFT's default) from a fixed
    seed and ``lora_B`` zero, so the merged weight starts as the base."""
    if config.init_from:
        from rlactors.lora.peft_io import load_peft_adapter

        return load_peft_adapter(config.init_from, model, config)
    generator = torch.Generator().manual_seed(_SEED)
    adapters = {}
    for name, linear in targeted(model, config):
        a = torch.empty(config.rank, linear.in_features)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        adapters[f"{name}.lora_A.weight"] = a
        adapters[f"{name}.lora_B.weight"] = torch.zeros(linear.out_features, config.rank)
    return adapters


def initial_adapters_of(args: ModelArgs, config: LoraConfig) -> dict[str, torch.Tensor]:
    """``initial_adapters`` of the plain decoder of `args`, without its weights (a vLLM replica's)."""
    with torch.device("meta"):
        model = DecoderForCausalLM(args)
    return initial_adapters(model, config)


def _add_adapters(linear: nn.Linear, config: LoraConfig, dtype: torch.dtype) -> None:
    device = linear.weight.device
    linear.lora_A = nn.Linear(linear.in_features, config.rank, bias=False, device=device, dtype=dtype)
    linear.lora_B = nn.Linear(config.rank, linear.out_features, bias=False, device=device, dtype=dtype)
    linear.lora_scale = scale(config)


class LoraLinear(nn.Linear):
    """A trainer's targeted plain linear: ``base(x) + B(A(dropout(x))) * scale``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.lora_scale


class MergedLoraLinear(InvariantLinear):
    """A trainer's targeted batch-invariant linear (true on-policy): it multiplies by
    ``merged_weight`` of its base and adapters (its forward and the stacked projections,
    ``rlactors.on_policy.modules.project``, both read ``matmul_weight``): the generator's merged
    weight, bit for bit."""

    def matmul_weight(self) -> torch.Tensor:
        return merged_weight(self.weight, self.lora_A.weight, self.lora_B.weight, self.lora_scale)


_TRAINER_CLASSES: dict[type[nn.Module], type[nn.Module]] = {
    nn.Linear: LoraLinear,
    InvariantLinear: MergedLoraLinear,
}


def to_lora(model: nn.Module, config: LoraConfig, base_dtype: torch.dtype) -> None:
    """The trainer's conversion, in place, after any batch-invariant one and before sharding:
    freezes every parameter, casts them to ``base_dtype`` (the compute dtype: the base keeps no
    fp32 master), and adds fp32 adapters to the targeted linears, the only parameters that train."""
    model.requires_grad_(False)
    for p in model.parameters():
        p.data = p.data.to(base_dtype)
    for _, linear in targeted(model, config):
        cls = _TRAINER_CLASSES.get(type(linear))
        if cls is None:
            raise ValueError(f"model.lora: cannot convert a {type(linear).__name__}")
        if cls is MergedLoraLinear and config.dropout:
            raise ValueError("model.lora.dropout must be 0 when the trainer merges (true on-policy)")
        _add_adapters(linear, config, torch.float32)
        linear.lora_dropout = nn.Dropout(config.dropout) if config.dropout else nn.Identity()
        linear.__class__ = cls


def attach_adapters(model: nn.Module, config: LoraConfig) -> None:
    """The native engine's conversion, after its weights are loaded: adds adapters (in the model's
    dtype, at ``initial_adapters``) to the targeted linears, keeps a copy of each one's base weight,
    and merges. The engine loads adapters into them and calls ``merge_adapters_``."""
    for _, linear in targeted(model, config):
        _add_adapters(linear, config, linear.weight.dtype)
        linear.lora_A.requires_grad_(False)
        linear.lora_B.requires_grad_(False)
        linear.lora_base = linear.weight.detach().clone()
    with torch.no_grad():
        params = adapter_parameters(model)
        for name, value in initial_adapters(model, config).items():
            params[name].copy_(value)
    merge_adapters_(model)


@torch.no_grad()
def merge_adapters_(model: nn.Module) -> None:
    """Writes each adapted linear's ``merged_weight`` into its ``weight``, in place (so views of
    it, cached transposes keyed by its version and captured graphs all see it)."""
    for m in model.modules():
        base = getattr(m, "lora_base", None)
        if base is not None:
            m.weight.copy_(merged_weight(base, m.lora_A.weight, m.lora_B.weight, m.lora_scale))


def merged_state(weights: dict[str, torch.Tensor], config: LoraConfig) -> dict[str, torch.Tensor]:
    """Full weights under HF names (base + adapters, as ``full_weights`` gathers them) merged into
    plain HF weights (``merged_weight`` per targeted linear), the adapters dropped."""
    merged = {name: t for name, t in weights.items() if not any(f".{a}." in name for a in ADAPTER_NAMES)}
    s = scale(config)
    for name in list(merged):
        prefix = name.removesuffix(".weight")
        if f"{prefix}.lora_A.weight" in weights:
            merged[name] = merged_weight(weights[name], weights[f"{prefix}.lora_A.weight"],
                                         weights[f"{prefix}.lora_B.weight"], s)
    return merged
