"""LoRA in a vLLM replica (rlactors.lora.replica), on CPU: the replica's merge into our model as
vLLM runs it (true on-policy) equals the trainer's merged weights bit for bit, and so do the
logits; each adapter version merges from the base; vLLM's fused q/k/v and gate/up rows; bad
adapters change nothing; the broadcast path's worker load and the engine's loads by messages merge
what they received."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch import nn

from rlactors import vllm_api
from rlactors.config import LoraConfig
from rlactors.engines.vllm_engine import VLLMEngine
from rlactors.lora.adapters import adapter_parameters, initial_adapters, initial_adapters_of, merged_weight, to_lora
from rlactors.lora.replica import MERGE_ATTRIBUTE, load_adapters
from rlactors.models import from_pretrained
from rlactors.models.checkpoint import load_args
from rlactors.on_policy.modules import to_batch_invariant
from rlactors.on_policy.vllm_model import to_engine_modules
from rlactors.weight_sync.broadcast import BufferReceiver, worker_load_staged
from rlactors.weight_sync.packed import PackedLayout

CONFIG = LoraConfig(rank=4, alpha=8.0)  # every linear


def random_adapters(model, seed):
    """Random fp32 values for the trainer's adapters (lora_B too: zero would test nothing)."""
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(p.shape, generator=g) * 0.1 for name, p in adapter_parameters(model).items()}


def trainer_and_replica(ckpt, dtype=torch.bfloat16):
    """The true on-policy trainer's model (merged LoRA linears) and a replica's (our model as vLLM
    runs it), on the same base in `dtype`."""
    trainer = from_pretrained(ckpt, dtype=dtype)
    to_batch_invariant(trainer)
    to_lora(trainer, CONFIG, dtype)
    replica = from_pretrained(ckpt, dtype=dtype)
    to_engine_modules(replica)
    return trainer, replica


def sent(adapters, dtype=torch.bfloat16):
    """What weight sync sends: the adapters in the model's dtype."""
    return {name: t.to(dtype) for name, t in adapters.items()}


def set_adapters(model, adapters):
    with torch.no_grad():
        for name, p in adapter_parameters(model).items():
            p.copy_(adapters[name])


def test_replica_merge_equals_the_trainers_merged_weights_and_logits_bitwise(tiny_ckpt):
    trainer, replica = trainer_and_replica(tiny_ckpt)
    adapters = random_adapters(trainer, seed=1)
    set_adapters(trainer, adapters)
    load_adapters(replica, sent(adapters).items(), CONFIG.alpha / CONFIG.rank)
    params = dict(replica.named_parameters())
    adapted = [(name, m) for name, m in trainer.named_modules() if hasattr(m, "lora_A")]
    assert len(adapted) == 7 * trainer.args.num_hidden_layers
    with torch.no_grad():
        for name, linear in adapted:
            assert torch.equal(params[f"{name}.weight"], linear.matmul_weight()), name
            assert not torch.equal(linear.matmul_weight(), linear.weight), name  # the adapters count
        # The stacked q/k/v weight the replica multiplies by holds the merged rows too.
        attention = replica.model.layers[0].self_attn
        assert torch.equal(attention.q_proj.stacked_weight[:attention.q_proj.weight.shape[0]],
                           trainer.model.layers[0].self_attn.q_proj.matmul_weight())
        ids = torch.randint(0, trainer.args.vocab_size, (21,), generator=torch.Generator().manual_seed(0))
        positions = torch.arange(21)
        assert torch.equal(replica.logits(replica.forward_packed(ids, positions)),
                           trainer.logits(trainer.forward_packed(ids, positions)))


def test_each_adapter_version_merges_from_the_base(tiny_ckpt):
    trainer, replica = trainer_and_replica(tiny_ckpt)
    base = {name: p.detach().clone() for name, p in replica.named_parameters()}
    scale = CONFIG.alpha / CONFIG.rank
    first, second = random_adapters(trainer, seed=1), random_adapters(trainer, seed=2)
    load_adapters(replica, sent(first).items(), scale)
    q = "model.layers.1.self_attn.q_proj"
    after_first = dict(replica.named_parameters())[f"{q}.weight"].detach().clone()
    load_adapters(replica, sent(second).items(), scale)
    params = dict(replica.named_parameters())
    a, b = sent(second)[f"{q}.lora_A.weight"], sent(second)[f"{q}.lora_B.weight"]
    assert torch.equal(params[f"{q}.weight"], merged_weight(base[f"{q}.weight"], a, b, scale))
    assert not torch.equal(params[f"{q}.weight"], merged_weight(after_first, a, b, scale))
    # Unadapted parameters are untouched.
    assert torch.equal(params["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    # B = 0 (a run's first version) gives the base back exactly.
    zero = {name: t * 0 if "lora_B" in name else t for name, t in first.items()}
    load_adapters(replica, sent(zero).items(), scale)
    assert all(torch.equal(p, base[name]) for name, p in replica.named_parameters())


def test_initial_adapters_of_a_replica_are_the_trainers(tiny_ckpt):
    trainer = from_pretrained(tiny_ckpt)
    to_lora(trainer, CONFIG, torch.float32)
    ours = initial_adapters_of(load_args(tiny_ckpt), CONFIG)
    theirs = initial_adapters(trainer, CONFIG)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[n], theirs[n]) for n in ours)


class FusedAttention(nn.Module):
    """vLLM's layout of a layer's q/k/v: one fused linear whose ``output_sizes`` give each part's rows."""

    def __init__(self, sizes, hidden):
        super().__init__()
        self.qkv_proj = nn.Linear(hidden, sum(sizes), bias=False, dtype=torch.bfloat16)
        self.qkv_proj.output_sizes = list(sizes)


class FusedModel(nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self, sizes=(8, 4, 4), hidden=6):
        super().__init__()
        self.attn = FusedAttention(sizes, hidden)


def fused_adapters(sizes, hidden, rank=2, parts=("q_proj", "k_proj", "v_proj")):
    g = torch.Generator().manual_seed(3)
    adapters = {}
    for part, rows in zip(("q_proj", "k_proj", "v_proj"), sizes):
        if part in parts:
            adapters[f"attn.{part}.lora_A.weight"] = torch.randn(rank, hidden, generator=g).bfloat16()
            adapters[f"attn.{part}.lora_B.weight"] = torch.randn(rows, rank, generator=g).bfloat16()
    return adapters


def test_fused_rows_each_merge_their_own_adapters():
    model = FusedModel()
    base = model.attn.qkv_proj.weight.detach().clone()
    adapters = fused_adapters((8, 4, 4), 6, parts=("q_proj", "v_proj"))  # k_proj not adapted
    load_adapters(model, adapters.items(), 0.5)
    merged = model.attn.qkv_proj.weight
    for part, (first, last) in (("q_proj", (0, 8)), ("v_proj", (12, 16))):
        expected = merged_weight(base[first:last], adapters[f"attn.{part}.lora_A.weight"],
                                 adapters[f"attn.{part}.lora_B.weight"], 0.5)
        assert torch.equal(merged[first:last], expected), part
    assert torch.equal(merged[8:12], base[8:12])


def test_bad_adapters_are_refused_before_anything_is_written():
    model = FusedModel()
    adapters = fused_adapters((8, 4, 4), 6)
    load_adapters(model, adapters.items(), 0.5)
    before = model.attn.qkv_proj.weight.detach().clone()
    wrong = dict(adapters)
    wrong["attn.v_proj.lora_B.weight"] = torch.zeros(5, 2, dtype=torch.bfloat16)
    wrong["attn.q_proj.lora_B.weight"] = torch.zeros(8, 2, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"attn\.v_proj: adapters A \(2, 6\), B \(5, 2\) do not fit its weight"):
        load_adapters(model, wrong.items(), 0.5)
    with pytest.raises(ValueError, match=r"adapters do not match the model's: missing \['attn\.k_proj\.lora_A"):
        load_adapters(model, {n: t for n, t in adapters.items() if "k_proj" not in n}.items(), 0.5)
    assert torch.equal(model.attn.qkv_proj.weight, before)
    unsized = FusedModel()
    del unsized.attn.qkv_proj.output_sizes
    with pytest.raises(ValueError, match=r"attn\.k_proj: the rows of attn\.qkv_proj cannot be told apart"):
        load_adapters(unsized, adapters.items(), 0.5)
    with pytest.raises(ValueError, match=r"attn\.o_proj: no parameter of the model holds its weight"):
        load_adapters(FusedModel(), {"attn.o_proj.lora_A.weight": torch.zeros(2, 6),
                                     "attn.o_proj.lora_B.weight": torch.zeros(6, 2)}.items(), 0.5)
    assert not hasattr(unsized, MERGE_ATTRIBUTE)


def test_a_vllm_workers_staged_load_merges_the_received_adapters():
    """`worker_load_staged` with a scale: the receive buffer's adapters merged into the worker's
    model (the broadcast path of a LoRA run), the model's own parameters loaded by no other way."""
    model = FusedModel()
    base = model.attn.qkv_proj.weight.detach().clone()
    adapters = fused_adapters((8, 4, 4), 6)
    layout = PackedLayout.of(adapters.items())
    receiver = BufferReceiver(layout, torch.device("cpu"))
    for name, view in layout.views(receiver.buffer):
        view.copy_(adapters[name])

    class Worker:
        rlactors_receiver = receiver

        def get_model(self):
            return model

    timings = worker_load_staged(Worker(), 0.5)
    assert timings["load_s"] >= 0 and not hasattr(Worker, "rlactors_copy_plan")
    expected = merged_weight(base[:8], adapters["attn.q_proj.lora_A.weight"], adapters["attn.q_proj.lora_B.weight"],
                             0.5)
    assert torch.equal(model.attn.qkv_proj.weight[:8], expected)


def test_a_vllm_engine_with_lora_merges_its_first_adapters_and_each_load_of_adapters(tiny_ckpt, monkeypatch):
    """`VLLMEngine` (vLLM's engine a stand-in that runs `apply_model` on our model as vLLM runs
    it): the first adapters merged at start, then adapters by messages checked against the
    model's and merged, as the trainer's merged weights; the broadcast receiver merges too."""
    for name, module in {"vllm": types.SimpleNamespace(SamplingParams=object, __version__=vllm_api.SUPPORTED[0]),
                         "vllm.sampling_params": types.SimpleNamespace(
                             RequestOutputKind=types.SimpleNamespace(DELTA="delta", FINAL_ONLY="final"))}.items():
        monkeypatch.setitem(sys.modules, name, module)
    trainer, replica = trainer_and_replica(tiny_ckpt)
    base = {name: p.detach().clone() for name, p in replica.named_parameters()}
    resets = []
    llm_engine = types.SimpleNamespace(apply_model=lambda func: [func(replica)],
                                       reset_prefix_cache=lambda **kwargs: resets.append(kwargs))
    scale = CONFIG.alpha / CONFIG.rank
    first = initial_adapters_of(trainer.args, CONFIG)
    engine = VLLMEngine(llm_engine, vocab_size=trainer.args.vocab_size, max_model_len=64, adapters=first,
                        lora_scale=scale)
    assert hasattr(replica, MERGE_ATTRIBUTE)  # B = 0: the base as it was
    assert all(torch.equal(p, base[name]) for name, p in replica.named_parameters())
    adapters = random_adapters(trainer, seed=1)
    set_adapters(trainer, adapters)
    with pytest.raises(ValueError, match=r"weights do not match the model's LoRA adapters: unknown "
                                         r"\['model\.embed_tokens\.weight'\], missing \[\]"):
        engine.check_weights({**sent(adapters), "model.embed_tokens.weight": base["model.embed_tokens.weight"]})
    engine.load_weights(sent(adapters), version=1)
    assert engine.version == 1 and resets == [{"reset_running_requests": True}]
    q = trainer.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        assert torch.equal(dict(replica.named_parameters())["model.layers.0.self_attn.q_proj.weight"],
                           q.matmul_weight())
    assert engine.broadcast_receiver().lora_scale == scale
