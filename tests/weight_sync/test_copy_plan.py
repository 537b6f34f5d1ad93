"""CopyPlan against a model whose load_weights fuses HF tensors the way vLLM's Qwen3, Qwen2 and
Llama do (q/k/v into qkv_proj, biases too; gate/up into gate_up_proj), and one holding experts
as vLLM's Qwen3-MoE does (FusedMoE's w13_weight / w2_weight)."""

import pytest
import torch
from torch import nn

from rlactors.weight_sync.copy_plan import CopyPlan
from rlactors.weight_sync.packed import PackedLayout

HIDDEN, HEAD, KV, FFN, VOCAB = 8, 8, 4, 12, 16
STACKED = {"q_proj": ("qkv_proj", 0, HEAD), "k_proj": ("qkv_proj", HEAD, KV), "v_proj": ("qkv_proj", HEAD + KV, KV),
           "gate_proj": ("gate_up_proj", 0, FFN), "up_proj": ("gate_up_proj", FFN, FFN)}


def hf_weights(seed: int, qkv_bias: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,)}
    for i in range(2):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (HEAD, HIDDEN), p + "self_attn.k_proj.weight": (KV, HIDDEN),
                   p + "self_attn.v_proj.weight": (KV, HIDDEN), p + "self_attn.o_proj.weight": (HIDDEN, HEAD),
                   p + "mlp.gate_proj.weight": (FFN, HIDDEN), p + "mlp.up_proj.weight": (FFN, HIDDEN),
                   p + "mlp.down_proj.weight": (HIDDEN, FFN), p + "input_layernorm.weight": (HIDDEN,)}
        if qkv_bias:  # Qwen2
            shapes |= {p + "self_attn.q_proj.bias": (HEAD,), p + "self_attn.k_proj.bias": (KV,),
                       p + "self_attn.v_proj.bias": (KV,)}
    return {name: torch.randn(shape, generator=g).to(torch.bfloat16) for name, shape in shapes.items()}


class FusedModel(nn.Module):
    """vLLM-style: q/k/v and gate/up live in fused parameters; load_weights places HF tensors."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, shard: int = 1, scale_k: float = 1.0, qkv_bias: bool = False):
        super().__init__()
        self.shard, self.scale_k = shard, scale_k
        self.params = nn.ParameterDict()
        for name, tensor in hf_weights(0, qkv_bias).items():
            *module, leaf, kind = name.split(".")
            fused, _, _ = STACKED.get(leaf, (leaf, 0, 0))
            rows = {"qkv_proj": HEAD + 2 * KV, "gate_up_proj": 2 * FFN}.get(fused, tensor.shape[0])
            key = ".".join([*module, fused, kind])
            self.params[key.replace(".", "__")] = nn.Parameter(torch.zeros(rows // shard, *tensor.shape[1:],
                                                                           dtype=torch.bfloat16), requires_grad=False)

    def named_parameters(self, *args, **kwargs):
        for key, param in self.params.items():
            yield key.replace("__", "."), param

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, tensor in weights:
            *module, leaf, kind = name.split(".")
            fused, first, rows = STACKED.get(leaf, (leaf, 0, tensor.shape[0]))
            if leaf == "k_proj":
                tensor = tensor * self.scale_k
            params[".".join([*module, fused, kind])].data[first // self.shard:(first + rows) // self.shard].copy_(
                tensor[:rows // self.shard])


def received(seed: int, layout: PackedLayout, buffer: torch.Tensor, qkv_bias: bool = False) -> torch.Tensor:
    return layout.pack(hf_weights(seed, qkv_bias), buffer)


@pytest.mark.parametrize("qkv_bias", [False, True], ids=["qwen3_llama", "qwen2"])
def test_a_verified_plan_loads_new_weights_exactly_as_load_weights_does(qkv_bias):
    layout = PackedLayout.of(hf_weights(0, qkv_bias))
    buffer = received(0, layout, layout.empty("cpu").zero_(), qkv_bias)
    model = FusedModel(qkv_bias=qkv_bias)
    assert ("model.layers.0.self_attn.qkv_proj.bias" in dict(model.named_parameters())) == qkv_bias
    model.load_weights(layout.views(buffer))
    plan = CopyPlan.derive(model, layout, buffer)
    assert plan is not None and len(plan.targets) == len(layout.specs)

    received(1, layout, buffer, qkv_bias)  # the next version arrives in the same buffer
    plan.apply()
    reference = FusedModel(qkv_bias=qkv_bias)
    reference.load_weights(layout.views(buffer))
    for (name, actual), (_, expected) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(actual, expected), name
    before = dict(FusedModel(qkv_bias=qkv_bias).named_parameters())  # and the load did change every parameter
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_no_plan_where_copies_would_differ_from_load_weights():
    weights = hf_weights(0)
    layout = PackedLayout.of(weights)
    buffer = received(0, layout, layout.empty("cpu").zero_())
    for model in (FusedModel(scale_k=2.0),  # the loader transforms a tensor
                  FusedModel(shard=2)):  # a tensor-parallel worker holds half of each parameter
        model.load_weights(layout.views(buffer))
        assert CopyPlan.derive(model, layout, buffer) is None

    extra = PackedLayout.of({**weights, "lm_head.weight": weights["model.embed_tokens.weight"]})
    buffer = extra.pack({**weights, "lm_head.weight": weights["model.embed_tokens.weight"]}, extra.empty("cpu").zero_())
    model = FusedModel()
    model.load_weights((n, t) for n, t in extra.views(buffer) if n != "lm_head.weight")
    assert CopyPlan.derive(model, extra, buffer) is None  # a received tensor the model has no place for

    model = FusedModel()
    model.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    buffer = received(0, layout, layout.empty("cpu").zero_())
    model.load_weights(layout.views(buffer))
    assert CopyPlan.derive(model, layout, buffer) is None  # a parameter whose sources it cannot name


EXPERTS = 4


class FusedExpertsModel(nn.Module):
    """vLLM's Qwen3-MoE layout: a router ``mlp.gate`` and ``mlp.experts.routed_experts.w13_weight /
    w2_weight``; load_weights takes the trainer's fused ``mlp.experts.gate_up_proj [E, 2I, H]``
    and ``down_proj [E, H, I]`` as vLLM 0.26's RoutedExperts.load_weights does for 3-D tensors:
    gate_up chunked in two along dim 1 (w1 = gate, w3 = up), each expert copied in turn."""

    def __init__(self, swap_gate_up: bool = False):
        super().__init__()
        self.swap_gate_up = swap_gate_up
        self.gate = nn.Parameter(torch.zeros(EXPERTS, HIDDEN, dtype=torch.bfloat16), requires_grad=False)
        self.w13 = nn.Parameter(torch.zeros(EXPERTS, 2 * FFN, HIDDEN, dtype=torch.bfloat16), requires_grad=False)
        self.w2 = nn.Parameter(torch.zeros(EXPERTS, HIDDEN, FFN, dtype=torch.bfloat16), requires_grad=False)

    def named_parameters(self, *args, **kwargs):
        yield "model.layers.0.mlp.gate.weight", self.gate
        yield "model.layers.0.mlp.experts.routed_experts.w13_weight", self.w13
        yield "model.layers.0.mlp.experts.routed_experts.w2_weight", self.w2

    def load_weights(self, weights):
        for name, tensor in weights:
            if name.endswith("gate.weight"):
                self.gate.data.copy_(tensor)
            elif name.endswith("gate_up_proj"):
                gate, up = tensor.chunk(2, dim=1)
                w1, w3 = (up, gate) if self.swap_gate_up else (gate, up)
                for e in range(EXPERTS):
                    self.w13.data[e, :FFN].copy_(w1[e])
                    self.w13.data[e, FFN:].copy_(w3[e])
            else:
                for e in range(EXPERTS):
                    self.w2.data[e].copy_(tensor[e])


def trainer_experts(seed):
    g = torch.Generator().manual_seed(seed)
    shapes = {"model.layers.0.mlp.gate.weight": (EXPERTS, HIDDEN),
              "model.layers.0.mlp.experts.gate_up_proj": (EXPERTS, 2 * FFN, HIDDEN),
              "model.layers.0.mlp.experts.down_proj": (EXPERTS, HIDDEN, FFN)}
    return {name: torch.randn(shape, generator=g).to(torch.bfloat16) for name, shape in shapes.items()}


def test_fused_experts_load_by_one_copy_each_into_vllms_layout():
    layout = PackedLayout.of(trainer_experts(0))
    buffer = layout.pack(trainer_experts(0), layout.empty("cpu").zero_())
    model = FusedExpertsModel()
    model.load_weights(layout.views(buffer))
    plan = CopyPlan.derive(model, layout, buffer)
    assert plan is not None and len(plan.targets) == 3  # the router, w13 and w2: one copy each
    layout.pack(trainer_experts(1), buffer)
    plan.apply()
    reference = FusedExpertsModel()
    reference.load_weights(layout.views(buffer))
    for (name, actual), (_, expected) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(actual, expected) and actual.abs().max() > 0, name

    swapped = FusedExpertsModel(swap_gate_up=True)  # a loader that reorders: no plan
    swapped.load_weights(layout.views(buffer))
    assert CopyPlan.derive(swapped, layout, buffer) is None
