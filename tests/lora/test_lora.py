"""LoRA (model.lora) against PEFT on HF transformers' models: logits, the trainer (adapters train,
the base is frozen and outside the optimizer), adapter-only weight sync into the native engine,
checkpoints (resume; PEFT export that peft loads; merged HF weights) and true on-policy diff 0."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from support.lora import ALL_LINEARS, ATTENTION, assert_lora_true_on_policy_diff_is_zero, hf_model, peft_adapter
from support.trainer_inputs import one_rank_process_group, rows
from support.true_on_policy import make_core

from rlactors.config import LoraConfig, LossConfig
from rlactors.lora.adapters import adapter_parameters, merged_weight, targeted, to_lora
from rlactors.lora.peft_io import load_peft_adapter
from rlactors.models import DecoderForCausalLM, from_pretrained
from rlactors.models.checkpoint import load_args
from rlactors.on_policy.modules import to_batch_invariant
from rlactors.procs.placement import free_port
from rlactors.trainer.core import LORA_DIR
from rlactors.trainer.losses import LossNorm
from rlactors.weight_sync.broadcast import BufferReceiver

peft = pytest.importorskip("peft")

def docs(vocab, lengths=(19, 7, 12), seed=3):
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
    return parts, torch.cat(parts), torch.cat([torch.arange(n) for n in lengths])


def peft_logits(model, parts):
    with torch.no_grad():
        return torch.cat([model(doc[None]).logits[0] for doc in parts])


def our_lora_model(ckpt, config, merged):
    """Our decoder of `ckpt` converted as the trainer converts it, adapters from `config.init_from`."""
    model = from_pretrained(ckpt, dtype=torch.float32)
    if merged:
        to_batch_invariant(model)
    to_lora(model, config, torch.float32)
    with torch.no_grad():
        params = adapter_parameters(model)
        for name, value in load_peft_adapter(config.init_from, model, config).items():
            params[name].copy_(value)
    return model


@pytest.mark.parametrize("merged", [False, True], ids=["default", "true_on_policy"])
@pytest.mark.parametrize("family,targets", [("qwen3", ALL_LINEARS), ("qwen3_moe", ATTENTION)])
def test_logits_equal_peft(family, targets, merged, family_ckpt, tmp_path):
    ckpt = family_ckpt(family)
    reference = peft_adapter(ckpt, tmp_path, targets)
    config = LoraConfig(rank=4, alpha=8.0, target_modules=targets, init_from=str(tmp_path))
    ours = our_lora_model(ckpt, config, merged)
    parts, input_ids, positions = docs(ours.args.vocab_size)
    with torch.no_grad():
        logits = ours.logits(ours.forward_packed(input_ids, positions))
    expected = peft_logits(reference, parts)
    assert (logits - expected).abs().max() <= 1e-5
    with reference.disable_adapter():  # the adapters change the logits: the test is not vacuous
        assert (peft_logits(reference, parts) - expected).abs().max() > 1e-2


def test_a_target_that_matches_no_linear_fails_naming_it(tiny_ckpt):
    args = load_args(tiny_ckpt)
    with torch.device("meta"):
        dense = DecoderForCausalLM(args)
    dense.model.layers[1].mlp.gate_proj = torch.nn.Identity()  # gate_proj left in 3 layers
    assert len(targeted(dense, LoraConfig(rank=2, target_modules=("gate_proj",)))) == 3
    del dense.model.layers[0].self_attn.v_proj, dense.model.layers[1].self_attn.v_proj
    dense.model.layers = dense.model.layers[:2]
    with pytest.raises(ValueError, match=r"model.lora.target_modules: \['v_proj'\] match no linear"):
        targeted(dense, LoraConfig(rank=2, target_modules=("q_proj", "v_proj")))


def test_moe_models_take_attention_targets_only(family_ckpt):
    """PEFT reads gate/up/down_proj targets on Qwen3-MoE as the experts, which model.lora does not
    adapt: such a config fails rather than export an adapter PEFT would apply elsewhere."""
    args = load_args(family_ckpt("qwen3_moe"))
    with torch.device("meta"):
        model = DecoderForCausalLM(args)
    assert len(targeted(model, LoraConfig(rank=2, target_modules=ATTENTION))) == 4 * model.args.num_hidden_layers
    with pytest.raises(ValueError, match=r"model.lora.target_modules: \['down_proj'\] on a mixture-of-experts"):
        targeted(model, LoraConfig(rank=2, target_modules=("q_proj", "down_proj")))


def test_a_peft_adapter_of_another_rank_fails_naming_it(tiny_ckpt, tmp_path):
    peft_adapter(tiny_ckpt, tmp_path, ATTENTION, rank=4)
    model = from_pretrained(tiny_ckpt, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"rank 4 != model.lora.rank 8"):
        load_peft_adapter(tmp_path, model, LoraConfig(rank=8, alpha=8.0, target_modules=ATTENTION))
    with pytest.raises(ValueError, match="not a PEFT adapter dir"):
        load_peft_adapter(tmp_path / "nothing", model, LoraConfig(rank=4, alpha=8.0, target_modules=ATTENTION))


@pytest.fixture(scope="module")
def device():
    with one_rank_process_group("cpu") as device:
        yield device


def train_step(core, seed):
    batches = rows(seed, count=2)
    loss = LossConfig(name="dapo", clip_high=0.28)
    norm = LossNorm.for_step(batches, loss.name, max_tokens=40)
    for mb in batches:
        core.forward_backward([mb], norm, loss)
    return core.optim_step()


def test_trainer_trains_syncs_checkpoints_and_exports_the_adapters_only(tiny_ckpt, device, tmp_path):
    from rlactors.config import GeneratorConfig, ModelConfig
    from rlactors.engines.native import NativeEngine
    from rlactors.weight_sync.checksum import state_checksum

    config = LoraConfig(rank=8, alpha=16.0, target_modules=ALL_LINEARS)
    core = make_core(tiny_ckpt, device, true_on_policy=False, lora=config)
    core.config.lr = 1e-2
    adapters = adapter_parameters(core.model)
    assert len(adapters) == 2 * 7 * core.args.num_hidden_layers
    trainable = {id(p) for group in core.optimizer.param_groups for p in group["params"]}
    assert trainable == {id(p) for p in adapters.values()}
    base_before = {n: p.detach().clone() for n, p in core.model.named_parameters() if n not in adapters}
    b_before = {n: p.detach().clone() for n, p in adapters.items()}
    batches = rows(1, count=2)
    loss = LossConfig(name="dapo", clip_high=0.28)
    core.forward_backward([batches[0]], LossNorm.for_step(batches[:1], loss.name, max_tokens=40), loss)
    grads = {n: p.grad for n, p in core.model.named_parameters()}
    assert all(grads[n] is None for n in base_before)
    assert all(grads[n] is not None and grads[n].abs().sum() > 0 for n in adapters if "lora_A" not in n)
    core.optim_step()
    assert all(torch.equal(p, base_before[n]) for n, p in core.model.named_parameters() if n in base_before)
    assert all(not torch.equal(adapters[n], b_before[n]) for n in adapters if "lora_B" in n)

    # Weight sync: the adapters alone, r * (in + out) values per linear, into the native engine.
    layout = core.weight_layout()
    assert {spec.name for spec in layout.specs} == set(adapters)
    per_linear = sum(config.rank * (m.in_features + m.out_features) for _, m in targeted(core.model, config))
    assert layout.total_bytes == 4 * per_linear  # fp32 (model.dtype)
    synced = core.state_dict_for_sync()
    assert synced.checksum == state_checksum(synced.weights)
    # By broadcast (gloo here) into a replica's receive buffer, verified by its checksum.
    receiver, port = BufferReceiver(layout, device), free_port()
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(receiver.join, "127.0.0.1", port, 1, 2)
        core.init_weight_sender("127.0.0.1", port, 2, layout)
        joined.result()
        received = pool.submit(receiver.receive, core.version)
        sent = asyncio.run(core.send_weights(core.version))
        received.result()
    assert sent["checksum"] == layout.checksum(receiver.buffer)
    assert all(torch.equal(t, synced.weights[n]) for n, t in receiver.weights().items())
    engine = NativeEngine.from_config(GeneratorConfig(max_num_seqs=4, kv_cache_tokens=512, max_model_len=256),
                                      ModelConfig(path=str(tiny_ckpt), lora=config), device="cpu")
    with pytest.raises(ValueError, match="missing"):
        engine.check_weights({"model.embed_tokens.weight": torch.zeros(1)})
    engine.load_weights(synced.weights, synced.version)
    q = engine.model.model.layers[0].self_attn.q_proj
    name = "model.layers.0.self_attn.q_proj"
    expected = merged_weight(q.lora_base, synced.weights[f"{name}.lora_A.weight"],
                             synced.weights[f"{name}.lora_B.weight"], config.alpha / config.rank)
    assert torch.equal(q.weight, expected) and not torch.equal(q.weight, q.lora_base)

    # Checkpoint: adapters + optimizer state resume; the PEFT export loads in peft with our logits,
    # and the merged HF weights give them too.
    path = core.save_checkpoint(tmp_path / "ckpt", step=1)
    resumed = make_core(tiny_ckpt, device, true_on_policy=False, lora=config)
    resumed.config.lr = 1e-2
    resumed.load_checkpoint(path)
    assert all(torch.equal(resumed_p, adapters[n]) for n, resumed_p in adapter_parameters(resumed.model).items())
    assert train_step(resumed, 5) == train_step(core, 5)
    # The same update: the optimizer state (AdamW's moments and step) came back too.
    assert all(torch.equal(p, adapters[n]) for n, p in adapter_parameters(resumed.model).items())
    parts, input_ids, positions = docs(core.args.vocab_size)
    with torch.no_grad():
        ours = resumed.model.logits(resumed.model.forward_packed(input_ids, positions))
    exported = peft.PeftModel.from_pretrained(hf_model(tiny_ckpt), f"{path}/{LORA_DIR}").eval()
    assert (peft_logits(exported, parts) - ours).abs().max() > 0  # the export is step 1's, not step 2's
    core.save_checkpoint(tmp_path / "ckpt", step=2)
    exported = peft.PeftModel.from_pretrained(hf_model(tiny_ckpt), f"{tmp_path}/ckpt/step_00000002/{LORA_DIR}")
    assert (peft_logits(exported.eval(), parts) - ours).abs().max() <= 1e-5
    assert (peft_logits(hf_model(f"{tmp_path}/ckpt/step_00000002/hf"), parts) - ours).abs().max() <= 1e-5


def test_lora_with_the_optimizer_offloaded_steps_bitwise_as_the_resident_one(tiny_ckpt, device):
    config = LoraConfig(rank=4, alpha=8.0, target_modules=ALL_LINEARS)
    plain = make_core(tiny_ckpt, device, true_on_policy=False, lora=config, lr=1e-2)
    offloaded = make_core(tiny_ckpt, device, true_on_policy=False, lora=config, lr=1e-2, offload_optimizer=True)
    assert len(offloaded._offload.groups) == offloaded.args.num_hidden_layers  # each layer's adapters
    for seed in (1, 2):
        assert train_step(offloaded, seed) == train_step(plain, seed)
    adapters = adapter_parameters(plain.model)
    assert all(torch.equal(p, adapters[n]) for n, p in adapter_parameters(offloaded.model).items())
    assert not all(torch.equal(p, q) for p, q in zip(adapters.values(), adapter_parameters(
        make_core(tiny_ckpt, device, true_on_policy=False, lora=config).model).values()))  # they trained


def test_native_true_on_policy_with_lora_logprob_diff_is_zero(tiny_ckpt, device, tmp_path):
    assert_lora_true_on_policy_diff_is_zero(tiny_ckpt, device, tmp_path)
