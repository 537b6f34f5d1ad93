"""PolicyTrainerCore on one gloo rank in this process (no Monarch): steps of every model family
against a plain-PyTorch reference, bad input, weights for sync, checkpoint save/load and their
failure paths."""

import asyncio
import dataclasses
import gc
import json
import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from support.trainer_inputs import cat, one_rank_process_group, rows
from torch.distributed.tensor import DTensor

from rlactors.config import ConfigError, LossConfig, ModelConfig, TeacherConfig, TrainerConfig
from rlactors.models.args import FAMILIES
from rlactors.models.checkpoint import (
    TIED_KEY,
    from_pretrained,
    fuse_experts,
    load_args,
    load_state_dict,
    model_shapes,
)
from rlactors.on_policy.sides import sides
from rlactors.procs.placement import free_port
from rlactors.trainer.batch import MicroBatch
from rlactors.trainer.checkpoint import COMPLETE_FILE, latest_checkpoint, partial_dir
from rlactors.trainer.core import MICROBATCH_FIELDS, PolicyTrainerCore
from rlactors.trainer.losses import LossNorm, compute_loss
from rlactors.trainer.reference import reference_bytes_per_rank
from rlactors.weight_sync.broadcast import BufferReceiver, UnexpectedVersion
from rlactors.weight_sync.packed import PackedLayout

VOCAB = 1024  # the tiny checkpoint's


@pytest.fixture(scope="module")
def device():
    """The CPU device the cores run on (the GPU tests' reference), in a one-rank process group for
    this test process (gloo; with CUDA, NCCL for CUDA tensors)."""
    with one_rank_process_group("cuda" if torch.cuda.is_available() else "cpu"):
        yield torch.device("cpu")


def make_core(ckpt, device, routing_replay=False, reference=False, teacher=None, **trainer):
    config = dict(ranks=1, lr=1e-2, max_grad_norm=0.005, weight_decay=0.1, warmup_steps=1, logprob_chunk_tokens=50)
    return PolicyTrainerCore(ModelConfig(path=str(ckpt), routing_replay=routing_replay),
                             TrainerConfig(**{**config, **trainer}), device, sides(False, "native", device).trainer,
                             reference=reference, teacher=teacher)


def step(core, batches, loss=LossConfig(name="dapo", clip_high=0.28)):
    norm = LossNorm.for_step(batches, loss.name, max_tokens=40)
    for mb in batches:
        core.forward_backward([mb], norm, loss)
    return core.optim_step()


def reference_steps(ckpt, steps, loss=LossConfig(name="dapo", clip_high=0.28)):
    """The same training in plain PyTorch: one unsharded fp32 model, whole batches, AdamW (and
    for the KL, an unsharded frozen copy of the initial model)."""
    model = from_pretrained(ckpt, dtype=torch.float32)
    frozen = from_pretrained(ckpt, dtype=torch.float32).requires_grad_(False) if loss.kl_coef > 0 else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    norms = []
    for lr, mb in zip([5e-3, 1e-2], steps):  # warmup_steps=1: half the LR on the first step
        norm = LossNorm.for_step([mb], loss.name, max_tokens=40)
        positions = mb.positions.reshape(-1)
        hidden = model.forward_packed(mb.input_ids.reshape(-1), positions)
        logprobs = model.token_logprobs(hidden, mb.target_ids.reshape(-1))
        reference = None if frozen is None else \
            frozen.token_logprobs(frozen.forward_packed(mb.input_ids.reshape(-1), positions), mb.target_ids.reshape(-1))
        value, _ = compute_loss(loss, norm, logprobs, mb.loss_mask.reshape(-1), mb.advantages.reshape(-1),
                                mb.generator_logprobs.reshape(-1), positions=positions, reference_logprobs=reference)
        value.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.005)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        optimizer.zero_grad()
    state = model.state_dict()
    state.pop(TIED_KEY)
    return state, norms


def assert_weights_close(actual, expected, atol):
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=atol, msg=name)


def grads(core):
    return {n: None if p.grad is None else p.grad.full_tensor().clone() for n, p in core.model.named_parameters()}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_two_steps_match_plain_pytorch_however_microbatched(family, family_ckpt, device):
    ckpt = family_ckpt(family)
    batch1, batch2 = rows(0), rows(1)
    expected, norms = reference_steps(ckpt, [cat(batch1), cat(batch2)])
    initial = fuse_experts(load_state_dict(ckpt), load_args(ckpt))
    core = make_core(ckpt, device)
    m1 = step(core, [cat(batch1[:1]), cat(batch1[1:])])
    m2 = step(core, [cat(batch2[:2]), cat(batch2[2:3]), cat(batch2[3:])])
    assert (m1["lr"], m2["lr"]) == (5e-3, 1e-2) and m2["policy_version"] == 2
    assert [m1["grad_norm"], m2["grad_norm"]] == pytest.approx(norms, rel=1e-5)
    assert min(norms) > 0.005  # clipping was active
    assert m1["tokens"] == LossNorm.for_step(batch1, "dapo").num_tokens
    nan_tokens = sum(int((mb.loss_mask & mb.generator_logprobs.isnan()).sum()) for mb in batch1)
    assert m1["nonfinite_logprob_tokens"] == nan_tokens > 0
    actual = core.full_weights(torch.float32)
    # AdamW moves each weight by up to the LR (1e-2) whatever its gradient's size, so an element
    # whose gradient is near 0 moves on summation-order noise: 3.3e-5 at most over 1-8 threads.
    assert_weights_close(actual, expected, atol=1e-4)
    moved = max((actual[n] - initial[n]).abs().max().item() for n in initial)
    assert moved > 1e-3  # the comparison above is far tighter than the update


@pytest.mark.parametrize("loss", [
    LossConfig(name="gspo", kl_coef=0.5, kl_estimator="k3"),
    LossConfig(name="cispo", clip_low=1.0, clip_high=0.28, tis_cap=2.0, tis_level="sequence", is_mask_high=5.0,
               is_mask_level="sequence"),
], ids=["gspo_kl", "cispo_sequence_tis_and_mask"])
def test_each_algorithm_steps_as_plain_pytorch_however_microbatched(loss, tiny_ckpt, device):
    """The sequence-level losses see whole sequences in any microbatching; the reference KL is to
    the initial weights, held frozen."""
    batch1, batch2 = rows(0, count=4), rows(1, count=4)
    expected, norms = reference_steps(tiny_ckpt, [cat(batch1), cat(batch2)], loss)
    core = make_core(tiny_ckpt, device, reference=loss.kl_coef > 0)
    m1 = step(core, [cat(batch1[:1]), cat(batch1[1:])], loss)
    m2 = step(core, [cat(batch2[:2]), cat(batch2[2:3]), cat(batch2[3:])], loss)
    assert [m1["grad_norm"], m2["grad_norm"]] == pytest.approx(norms, rel=1e-5)
    assert min(norms) > 0.005
    # AdamW moves each weight by up to the LR (1e-2) whatever its gradient's size: 1e-4 is far tighter.
    assert_weights_close(core.full_weights(torch.float32), expected, atol=1e-4)
    assert 0 < m1["is_ratio/p5"] <= m1["is_ratio/p50"] <= m1["is_ratio/p95"] <= m1["is_ratio/max"]
    if loss.kl_coef > 0:
        assert m1["kl/mean"] < 1e-6 < m2["kl/mean"]  # the first step starts at the reference
        assert core.reference.local_bytes() == reference_bytes_per_rank(core.args, torch.float32, ranks=1)
    else:
        assert core.reference is None


def test_a_teachers_logprobs_of_the_sampled_tokens_shape_the_advantages(tiny_ckpt, tiny_ckpt_untied, device):
    """On-policy distillation, with the task's advantage at half weight: one step on microbatches
    scored by the teacher (another model) equals plain PyTorch with advantages
    0.5 A - 2 (log p_student - log p_teacher); unscored microbatches are refused."""
    teacher = TeacherConfig(path=str(tiny_ckpt_untied), coef=2.0, task_coef=0.5)
    loss, mb = LossConfig(name="grpo"), cat(rows(0, count=4))
    student, frozen = from_pretrained(tiny_ckpt), from_pretrained(tiny_ckpt_untied).requires_grad_(False)
    flat = {name: getattr(mb, name).reshape(-1) for name in MICROBATCH_FIELDS}
    logprobs, teacher_logprobs = (m.token_logprobs(m.forward_packed(flat["input_ids"], flat["positions"]),
                                                   flat["target_ids"]) for m in (student, frozen))
    used = flat["loss_mask"] & flat["generator_logprobs"].isfinite()
    shaped = torch.where(used, 0.5 * flat["advantages"] - 2.0 * (logprobs.detach() - teacher_logprobs), 0.0)
    norm = LossNorm.for_step([mb], "grpo")
    value, _ = compute_loss(loss, norm, logprobs, flat["loss_mask"], shaped, flat["generator_logprobs"])
    value.backward()
    expected_norm = float(torch.nn.utils.clip_grad_norm_(student.parameters(), 0.005))
    core = make_core(tiny_ckpt, device, teacher=teacher)
    with pytest.raises(ValueError, match=r"^microbatches\[0\]\.teacher_logprobs is none, expected float32 \(4, 48\): "
                                         r"teacher\.path is set, the teacher mesh scores them$"):
        core.forward_backward([mb], norm, loss)
    scored = dataclasses.replace(mb, teacher_logprobs=teacher_logprobs.detach().reshape(mb.input_ids.shape))
    metrics = step(core, [scored], loss)
    assert metrics["grad_norm"] == pytest.approx(expected_norm, rel=1e-5)
    assert metrics["loss"] == pytest.approx(value.item(), rel=1e-5)
    reverse_kl = float(torch.where(used, logprobs.detach() - teacher_logprobs, 0.0).sum() / used.sum())
    assert metrics["teacher_kl/mean"] == pytest.approx(reverse_kl, rel=1e-5) and abs(reverse_kl) > 1e-3


def test_reference_bytes_count_each_ranks_rows_in_the_reference_dtype(tiny_ckpt):
    args = load_args(tiny_ckpt)
    shapes = model_shapes(args)
    rows_on_fullest_of_3 = sum(-(-s[0] // 3) * s[1:].numel() for s in shapes.values())
    assert reference_bytes_per_rank(args, torch.bfloat16, ranks=3) == 2 * rows_on_fullest_of_3
    assert reference_bytes_per_rank(args, torch.float32, ranks=1) == 4 * sum(s.numel() for s in shapes.values())
    with pytest.raises(ValueError, match="multiple of expert_parallel"):
        reference_bytes_per_rank(args, torch.float32, ranks=3, expert_parallel=2)


def test_router_aux_loss_is_off_by_default_and_adds_the_load_balancing_loss(family_ckpt, tiny_ckpt, device):
    ckpt, batch = family_ckpt("qwen3_moe"), rows(2)
    plain, balanced = make_core(ckpt, device), make_core(ckpt, device, router_aux_loss_coef=0.5)
    norm = LossNorm.for_step(batch, "dapo", max_tokens=40)
    for core in (plain, balanced):
        for mb in (cat(batch[:3]), cat(batch[3:])):
            core.forward_backward([mb], norm, LossConfig(name="dapo", clip_high=0.28))
    router = "model.layers.1.mlp.gate.weight"
    plain_grads, balanced_grads = grads(plain), grads(balanced)
    assert not torch.equal(plain_grads[router], balanced_grads[router])
    plain_metrics, balanced_metrics = plain.optim_step(), balanced.optim_step()
    assert "router_aux_loss" not in plain_metrics
    assert 1.0 <= balanced_metrics["router_aux_loss"] < 8  # 1 at an even load; at most num_experts
    assert balanced_metrics["loss"] == plain_metrics["loss"]  # the policy loss alone
    with pytest.raises(ConfigError, match=r"^trainer.router_aux_loss_coef: is 0.5, but .* \(qwen3\) has no experts$"):
        make_core(tiny_ckpt, device, router_aux_loss_coef=0.5)


def experts_used(core, mb):
    """``(expert ids, their weights, router probabilities)`` that ``core``'s sparse layers compute
    ``mb`` with, each ``[rows, width, sparse layers, ...]``."""
    from rlactors.models.moe import SparseMoeBlock

    used, probs = [], []
    blocks = [m for m in core.model.modules() if isinstance(m, SparseMoeBlock)]
    hooks = [m.experts.register_forward_hook(lambda _, inputs, out: used.append(inputs[1:])) for m in blocks]
    hooks += [m.gate.register_forward_hook(lambda _, inputs, logits: probs.append(logits.softmax(-1))) for m in blocks]
    core.compute_logprobs([mb])
    for hook in hooks:
        hook.remove()
    return tuple(torch.stack(t, dim=1).reshape(*mb.input_ids.shape, len(blocks), -1)
                 for t in ([i for i, _ in used], [w for _, w in used], probs))


def test_the_share_of_tokens_routed_to_other_experts_than_the_generators(family_ckpt, device):
    """Microbatches that carry the generator's routed experts: the trainer counts the current
    policy's loss tokens its routers send to another set of experts (in any sparse layer)."""
    core, mb = make_core(family_ckpt("qwen3_moe"), device), cat(rows(6)[:2])
    routed = experts_used(core, mb)[0].clone()  # 3 sparse layers, top 2
    routed[~mb.loss_mask] = -1  # prompt tokens: not returned
    routed[0, 5, 1] = routed[0, 5, 1].flip(-1)  # one token: its second layer's experts in another order (the same set)
    routed[0, 6, 0, 1] = (routed[0, 6, 0, 1] + 1) % 8  # another: a first layer's second expert ...
    routed[1, 10, 2, 0] = (routed[1, 10, 2, 0] + 1) % 8  # ... another: a third layer's first expert
    routed[1, 11] = -1  # and one not known
    assert (routed[0, 6, 0, 0] != routed[0, 6, 0, 1]) and (routed[1, 10, 2, 0] != routed[1, 10, 2, 1])
    assert mb.loss_mask[0, 5] and mb.loss_mask[0, 6] and mb.loss_mask[1, 10] and mb.loss_mask[1, 11]
    norm, loss = LossNorm.for_step([mb], "dapo"), LossConfig(name="dapo")
    core.forward_backward([MicroBatch(**{**vars(mb), "routed_experts": routed})], norm, loss)
    core.forward_backward([mb], norm, loss)  # no routed experts: counts nothing
    metrics = core.optim_step()
    assert metrics["routed_tokens"] == mb.num_loss_tokens - 1
    assert metrics["expert_mismatch/share"] == 2 / (mb.num_loss_tokens - 1)
    with pytest.raises(ValueError, match=r"routed_experts is torch.int64 \(2, 48, 3, 3\), expected int64 "
                                         r"\(2, 48, 3, 2\)"):
        core.forward_backward([MicroBatch(**{**vars(mb), "routed_experts": torch.zeros(2, 48, 3, 3).long()})],
                              norm, loss)


def test_routing_replay_computes_each_returned_token_with_the_generators_experts(family_ckpt, device):
    """With model.routing_replay, a token whose experts the generator returned goes to those
    experts, weighted by the trainer's router probabilities there (renormalized, as the tiny MoE's
    norm_topk_prob asks); the others keep their own top-k. The mismatch metric still counts the
    routers' own choice."""
    ckpt, mb = family_ckpt("qwen3_moe"), cat(rows(6)[:2])
    own = experts_used(make_core(ckpt, device), mb)[0]
    generator = (own + 3) % 8  # another set of experts in every layer (8 experts, top 2)
    generator[~mb.loss_mask] = -1  # prompt tokens: not returned
    replayed = MicroBatch(**{**vars(mb), "routed_experts": generator})
    core = make_core(ckpt, device, routing_replay=True)
    ids, weights, probs = experts_used(core, replayed)
    returned = mb.loss_mask
    assert torch.equal(ids[returned], generator[returned]) and torch.equal(ids[~returned], own[~returned])
    chosen = probs.gather(-1, ids)
    assert torch.equal(weights, chosen / (chosen[..., :1] + chosen[..., 1:]))
    assert torch.equal(experts_used(core, mb)[0], own)  # a microbatch without routed experts: its own
    norm, loss = LossNorm.for_step([mb], "dapo"), LossConfig(name="dapo")
    core.forward_backward([replayed], norm, loss)
    metrics = core.optim_step()
    assert metrics["routed_tokens"] == mb.num_loss_tokens and metrics["expert_mismatch/share"] == 1.0
    plain = make_core(ckpt, device)
    plain.forward_backward([replayed], norm, loss)
    assert plain.optim_step()["loss"] != metrics["loss"]


def test_activation_checkpointing_gives_the_same_step(tiny_ckpt, device):
    batch = rows(2)
    plain, checkpointed = make_core(tiny_ckpt, device), make_core(tiny_ckpt, device, activation_checkpointing=True)
    assert step(plain, [cat(batch)]) == step(checkpointed, [cat(batch)])
    assert_weights_close(checkpointed.full_weights(torch.float32), plain.full_weights(torch.float32), atol=0)


def optimizer_state(core):
    """AdamW's state by parameter name, as local tensors on the CPU."""
    names = {p: n for n, p in core.model.named_parameters()}
    return {names[p]: {k: (v.to_local() if hasattr(v, "to_local") else v).cpu() for k, v in state.items()}
            for p, state in core.optimizer.state.items()}


def test_offloaded_optimizer_steps_bitwise_as_the_resident_one_and_reloads(tiny_ckpt, device, tmp_path):
    """trainer.offload_optimizer: AdamW stepped a layer at a time, its state kept on the host
    (here the CPU is both), gives the plain step's weights and state bit for bit, and its
    checkpoint loads them back."""
    plain, offloaded = make_core(tiny_ckpt, device), make_core(tiny_ckpt, device, offload_optimizer=True)
    # 4 layers, the embedding (tied to the LM head) and the final norm
    assert offloaded._offload is not None and len(offloaded._offload.groups) == 6
    for mb in (cat(rows(12)), cat(rows(13))):
        assert step(offloaded, [mb]) == step(plain, [mb])
    # Between steps the moments wait as plain local shards: a DTensor around a host tensor would
    # have been moved back onto its mesh's device (the GPU) by DTensor.from_local.
    waiting = [v for state in offloaded.optimizer.state.values() for v in state.values()]
    assert len(waiting) == 3 * len(list(offloaded.model.parameters()))
    assert not any(isinstance(v, DTensor) for v in waiting)
    assert all(isinstance(v, DTensor) for state in plain.optimizer.state.values() for k, v in state.items()
               if k != "step")

    def assert_as_plain():
        assert_weights_close(offloaded.full_weights(torch.float32), plain.full_weights(torch.float32), atol=0)
        expected, actual = optimizer_state(plain), optimizer_state(offloaded)
        assert expected.keys() == actual.keys()
        for name, state in actual.items():
            assert state.keys() == expected[name].keys()
            assert all(torch.equal(value, expected[name][key]) for key, value in state.items()), name

    assert_as_plain()
    path = offloaded.save_checkpoint(tmp_path, step=2)
    offloaded.load_checkpoint(path)
    assert_as_plain()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_compute_logprobs_match_hf_transformers_per_document(family, family_ckpt, device):
    from transformers import AutoModelForCausalLM

    ckpt = family_ckpt(family, tie=False)
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    mb = cat(rows(3)[:2])
    logprobs = make_core(ckpt, device).compute_logprobs([mb])
    assert logprobs.shape == mb.input_ids.shape and logprobs.dtype == torch.float32
    for r in range(mb.input_ids.shape[0]):
        starts = (mb.positions[r] == 0).nonzero().flatten().tolist() + [mb.input_ids.shape[1]]
        for a, b in zip(starts, starts[1:]):
            with torch.no_grad():
                logits = hf(mb.input_ids[r, a:b][None]).logits[0].float()
            want = logits.log_softmax(-1).gather(-1, mb.target_ids[r, a:b, None]).squeeze(-1)
            torch.testing.assert_close(logprobs[r, a:b], want, rtol=0, atol=2e-5)


def _bad_inputs():
    good = rows(4, count=1)[0]

    def changed(**fields):
        return MicroBatch(**{**vars(good), **fields})

    norm = LossNorm.for_step([good], "grpo")
    out_of_vocab = good.target_ids.clone()
    out_of_vocab[0, 3] = VOCAB
    advantages = good.advantages.clone()
    advantages[good.loss_mask] = math.inf
    return norm, [
        ([changed(**{n: getattr(good, n)[:, :0] for n in MICROBATCH_FIELDS})], norm, "is empty"),
        ([changed(advantages=good.advantages[:, :-1])], norm,
         r"advantages has shape \(1, 47\), input_ids has \(1, 48\)"),
        ([changed(target_ids=out_of_vocab)], norm,
         r"target_ids holds token id 1024 outside the vocabulary \[0, 1024\)"),
        ([changed(input_ids=good.input_ids.float())], norm, "input_ids must hold integers"),
        ([changed(positions=good.positions + 1)], norm, "positions row 0: positions must start at 0"),
        ([changed(advantages=advantages)], norm, "advantages is not finite on a loss token"),
        ([good, good], norm, r"one microbatch per trainer rank \(1\), got 2"),
        ([good], LossNorm(num_tokens=1), "LossNorm.num_tokens is 1, but this call alone has"),
        ([good], LossNorm(num_tokens=0), "needs LossNorm.num_tokens >= 1"),
    ]


def test_bad_input_raises_and_changes_nothing(tiny_ckpt, device):
    core = make_core(tiny_ckpt, device)
    step(core, [cat(rows(5))])  # optimizer state exists
    norm, cases = _bad_inputs()
    core.forward_backward([rows(4, count=1)[0]], norm, LossConfig())  # gradients accumulated
    weights, grads_before = core.full_weights(torch.float32), grads(core)
    optimizer_before = {k: {n: t.full_tensor().clone() for n, t in v.items() if n != "step"}
                        for k, v in core.optimizer.state.items()}
    for microbatches, bad_norm, message in cases:
        with pytest.raises(ValueError, match=message):
            core.forward_backward(microbatches, bad_norm, LossConfig())
    with pytest.raises(ValueError, match="loss.clip_low"):
        core.forward_backward([rows(4, count=1)[0]], norm, LossConfig(clip_low=1.5))
    with pytest.raises(ValueError, match="loss.kl_coef > 0 needs the reference policy: this trainer was built"):
        core.forward_backward([rows(4, count=1)[0]], norm, LossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="dtype must be one of"):
        core.state_dict_for_sync("int8")
    assert core.version == 1
    assert_weights_close(core.full_weights(torch.float32), weights, atol=0)
    after = grads(core)
    assert all(torch.equal(after[n], grads_before[n]) for n in after)
    for key, state in core.optimizer.state.items():
        for name, t in optimizer_before[key].items():
            assert torch.equal(state[name].full_tensor(), t)


def test_optim_step_without_gradients_is_refused(tiny_ckpt, device):
    core = make_core(tiny_ckpt, device)
    with pytest.raises(ValueError, match="no gradients"):
        core.optim_step()
    assert core.version == 0 and not core.optimizer.state


def test_nonfinite_gradient_norm_skips_the_update(tiny_ckpt, device):
    core = make_core(tiny_ckpt, device)
    mb = cat(rows(6))
    mb.advantages[mb.loss_mask] = 1e30  # finite, but the squares of the gradients overflow fp32
    before = core.full_weights(torch.float32)
    metrics = step(core, [mb], LossConfig(name="grpo"))
    assert metrics["update_skipped"] == 1.0 and not math.isfinite(metrics["grad_norm"])
    assert metrics["policy_version"] == 0 and not core.optimizer.state
    assert_weights_close(core.full_weights(torch.float32), before, atol=0)
    assert step(core, [cat(rows(6))])["update_skipped"] == 0.0  # gradients were cleared


def test_sync_weights_are_the_full_policy_in_generator_dtype(tiny_ckpt, device):
    core = make_core(tiny_ckpt, device)
    step(core, [cat(rows(7))])
    synced = core.state_dict_for_sync()  # ModelConfig.dtype defaults to float32
    bf16 = core.state_dict_for_sync("bfloat16")
    on_disk = load_state_dict(tiny_ckpt)
    assert synced.version == bf16.version == 1
    assert synced.weights.keys() == on_disk.keys()  # HF names; the tied lm_head is not repeated
    for name, tensor in bf16.weights.items():
        assert tensor.dtype == torch.bfloat16 and tensor.shape == on_disk[name].shape
        assert torch.equal(tensor, synced.weights[name].to(torch.bfloat16))


def test_checkpoint_resume_is_bitwise_identical(tiny_ckpt, device, tmp_path):
    batches = [cat(rows(s)) for s in (8, 9, 10)]
    uninterrupted = make_core(tiny_ckpt, device)
    for mb in batches[:2]:
        step(uninterrupted, [mb])
    path = uninterrupted.save_checkpoint(tmp_path, step=2)
    expected = step(uninterrupted, [batches[2]])

    resumed = make_core(tiny_ckpt, device)
    assert resumed.load_checkpoint(path) == {"step": 2, "policy_version": 2}
    assert step(resumed, [batches[2]]) == expected
    assert_weights_close(resumed.full_weights(torch.float32), uninterrupted.full_weights(torch.float32), atol=0)


def test_checkpoint_before_the_first_step_keeps_adam_untouched(tiny_ckpt, device, tmp_path):
    mb = cat(rows(11))
    saved = make_core(tiny_ckpt, device)
    path = saved.save_checkpoint(tmp_path, step=0)
    assert not saved.optimizer.state  # saving did not create optimizer state
    expected = step(saved, [mb])
    resumed = make_core(tiny_ckpt, device)
    resumed.load_checkpoint(path)
    assert step(resumed, [mb]) == expected
    assert_weights_close(resumed.full_weights(torch.float32), saved.full_weights(torch.float32), atol=0)


def test_checkpoint_layout_and_hf_export(tiny_ckpt, device, tmp_path):
    core = make_core(tiny_ckpt, device)
    step(core, [cat(rows(12))])
    path = core.save_checkpoint(tmp_path / "ckpts", step=7)
    assert path == str(tmp_path / "ckpts" / "step_00000007")
    assert json.loads((tmp_path / "ckpts" / "step_00000007" / "trainer_state.json").read_text())["policy_version"] == 1
    hf = from_pretrained(f"{path}/hf")  # loads as an ordinary HF checkpoint dir, tokenizer included
    state = hf.state_dict()
    for name, tensor in core.full_weights(torch.float32).items():
        assert torch.equal(state[name], tensor), name
    assert (tmp_path / "ckpts" / "step_00000007" / "hf" / "tokenizer.json").is_file()
    modes = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "ckpts" / "step_00000007" / "hf").iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] == modes["tokenizer.json"], modes
    assert sorted(p.name for p in (tmp_path / "ckpts").iterdir()) == ["step_00000007"]  # no partial left


def test_incomplete_checkpoints_are_ignored_and_refused(tiny_ckpt, device, tmp_path):
    core = make_core(tiny_ckpt, device)
    assert latest_checkpoint(tmp_path) is None
    step(core, [cat(rows(13))])
    first = core.save_checkpoint(tmp_path, step=1)
    step(core, [cat(rows(14))])
    second = core.save_checkpoint(tmp_path, step=2)
    assert str(latest_checkpoint(tmp_path)) == second
    # A crash mid-save: the partial dir of step 3, and a step dir whose COMPLETE never got written.
    partial_dir(tmp_path, 3).mkdir()
    (tmp_path / "step_00000002" / COMPLETE_FILE).unlink()
    assert str(latest_checkpoint(tmp_path)) == first
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        core.load_checkpoint(second)
    assert core.version == 2
    # Saving step 2 again replaces the broken dir and removes the stale partial of its own step only.
    assert core.save_checkpoint(tmp_path, step=2) == second
    assert str(latest_checkpoint(tmp_path)) == second


def test_save_with_accumulated_gradients_is_refused(tiny_ckpt, device, tmp_path):
    core = make_core(tiny_ckpt, device)
    mb = cat(rows(15))
    core.forward_backward([mb], LossNorm.for_step([mb], "grpo"), LossConfig())
    with pytest.raises(ValueError, match="without optim_step"):
        core.save_checkpoint(tmp_path, step=1)
    assert not list(tmp_path.iterdir())


def test_load_from_an_hf_dir_restarts_at_version_0(tiny_ckpt, tiny_ckpt_untied, device, tmp_path):
    core = make_core(tiny_ckpt, device)
    initial = core.full_weights(torch.float32)
    step(core, [cat(rows(16))])
    assert core.load_checkpoint(tiny_ckpt) == {"step": 0, "policy_version": 0}
    assert not core.optimizer.state
    assert_weights_close(core.full_weights(torch.float32), initial, atol=0)
    with pytest.raises(ValueError, match="another shape"):
        core.load_checkpoint(tiny_ckpt_untied)
    with pytest.raises(ValueError, match="neither a trainer checkpoint nor a HF model dir"):
        core.load_checkpoint(tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_cuda_bf16_compiled_step_tracks_the_fp32_cpu_step(family, family_ckpt, device):
    ckpt = family_ckpt(family)
    batch = cat(rows(17))
    cpu = make_core(ckpt, device)
    cuda = make_core(ckpt, torch.device("cuda", 0))  # bf16 mixed precision, compiled layers
    torch.testing.assert_close(cuda.compute_logprobs([batch]), cpu.compute_logprobs([batch]), rtol=0, atol=0.05)
    expected, actual = step(cpu, [batch]), step(cuda, [batch])
    assert actual["grad_norm"] == pytest.approx(expected["grad_norm"], rel=0.03)
    assert actual["loss"] == pytest.approx(expected["loss"], rel=0.03, abs=1e-4)
    # The update is lr * sign-like (Adam's first step): bf16 noise flips only gradients near zero.
    moved = cpu.full_weights(torch.float32)
    for name, tensor in cuda.full_weights(torch.float32).items():
        assert (tensor - moved[name]).abs().float().mean() < 2e-3, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_offloaded_moments_leave_the_gpu_between_steps(tiny_ckpt, device):
    """The same step with the optimizer resident and offloaded: between steps the offloaded one
    holds AdamW's two fp32 moments (2 x the fp32 weights) less on the GPU, and they wait in pinned
    host memory. Compared side by side, since the GPU also holds what is no model's (cuBLAS's
    workspaces, tens of MiB beside the tiny model's few), after a first step that makes what the
    process keeps once made."""
    cuda = torch.device("cuda", 0)

    def allocated_after_a_step(offload: bool) -> tuple[int, int, bool]:
        core = make_core(tiny_ckpt, cuda, offload_optimizer=offload)
        step(core, [cat(rows(17))])
        torch.cuda.synchronize()
        weights = sum(p.to_local().numel() * 4 for p in core.model.parameters())  # fp32 shards
        moments = [v for state in core.optimizer.state.values() for k, v in state.items() if k != "step"]
        on_host = bool(moments) and all(v.device.type == "cpu" and v.is_pinned() for v in moments)
        allocated = torch.cuda.memory_allocated(cuda)
        del core, moments
        gc.collect()
        torch.cuda.empty_cache()
        return allocated, weights, on_host

    allocated_after_a_step(offload=False)
    resident, weights, resident_on_host = allocated_after_a_step(offload=False)
    offloaded, _, offloaded_on_host = allocated_after_a_step(offload=True)
    assert offloaded_on_host and not resident_on_host
    assert 2 * weights <= resident - offloaded < 2 * weights + (1 << 20), (resident, offloaded, weights)


def test_the_policy_sent_in_chunks_arrives_bit_for_bit_and_verified(tiny_ckpt, device):
    """One rank's weight broadcast in chunks cut between rows (the embedding in three), packed and
    sent one after another over a gloo group to a receiver: the whole policy in the layout's dtype.
    The group forms before the first step, as a run's does; the sends carry the weights of each
    later step and of a checkpoint load (all of which write the parameters in place)."""
    core = make_core(tiny_ckpt, device)
    layout = core.weight_layout("bfloat16")
    chunked = PackedLayout.of([(s.name, torch.empty(s.shape, dtype=s.torch_dtype, device="meta"))
                               for s in layout.specs], chunk_bytes=96 << 10)
    receiver, port = BufferReceiver(chunked, device), free_port()
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(receiver.join, "127.0.0.1", port, 1, 2)
        core.init_weight_sender("127.0.0.1", port, 2, chunked)
        joined.result()
    assert len(chunked.chunks) > 3
    for change in (lambda: step(core, [cat(rows(7))]), lambda: step(core, [cat(rows(8))]),
                   lambda: core.load_checkpoint(tiny_ckpt)):
        change()
        with ThreadPoolExecutor(1) as pool:
            received = pool.submit(receiver.receive, core.version)
            sent = asyncio.run(core.send_weights(core.version))
            received.result()
        assert sent["version"] == core.version and sent["checksum"] == chunked.checksum(receiver.buffer)
        assert 0 < sent["pack_s"] <= sent["send_device_s"] <= sent["send_s"]
        expected = core.state_dict_for_sync("bfloat16").weights
        assert all(torch.equal(tensor, expected[name]) for name, tensor in receiver.weights().items())
    with pytest.raises(ValueError, match="the weight layout is not this policy's in one dtype"):
        core.init_weight_sender("127.0.0.1", port, 2, PackedLayout.of({"w": torch.zeros(2)}))


def test_a_send_made_with_the_optimizer_step_goes_as_it_ends_and_after_a_skipped_update_is_refused(
        tiny_ckpt, device):
    """`send_weights(version)` made before the optimizer step that makes `version` waits for
    that step and sends its policy. After a step that skipped its update (a non-finite gradient)
    it sends the policy the step left, which the receiver, told to expect `version`, refuses. A
    checkpoint load forgets the steps tried."""
    core = make_core(tiny_ckpt, device)
    layout = core.weight_layout("bfloat16")
    receiver, port = BufferReceiver(layout, device), free_port()
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(receiver.join, "127.0.0.1", port, 1, 2)
        core.init_weight_sender("127.0.0.1", port, 2, layout)
        joined.result()

    async def send_with_step(mb, loss=LossConfig(name="grpo")):
        sending = asyncio.ensure_future(core.send_weights(core.version + 1))
        await asyncio.sleep(0.2)
        waited = not sending.done()
        metrics = step(core, [mb], loss)
        return waited, metrics, await sending

    with ThreadPoolExecutor(1) as pool:
        received = pool.submit(receiver.receive, 1)
        waited, metrics, sent = asyncio.run(send_with_step(cat(rows(7))))
        received.result()
    assert waited and metrics["policy_version"] == sent["version"] == 1 and sent["verified"] == 1
    assert sent["step_wait_s"] >= 0.2
    expected = core.state_dict_for_sync("bfloat16").weights
    assert all(torch.equal(tensor, expected[name]) for name, tensor in receiver.weights().items())

    overflowing = cat(rows(6))
    overflowing.advantages[overflowing.loss_mask] = 1e30  # the squares of the gradients overflow fp32
    with ThreadPoolExecutor(1) as pool:
        received = pool.submit(receiver.receive, 2)
        waited, metrics, sent = asyncio.run(send_with_step(overflowing))
        with pytest.raises(UnexpectedVersion, match="weights version 2 expected, the broadcast carried version 1"):
            received.result()
    assert waited and metrics["update_skipped"] == 1.0 and sent["version"] == 1 and sent["verified"] == 0

    core.load_checkpoint(tiny_ckpt)  # version 0 again: a send of version 1 waits for the next step
    with ThreadPoolExecutor(1) as pool:
        received = pool.submit(receiver.receive, 1)
        waited, metrics, sent = asyncio.run(send_with_step(cat(rows(8))))
        received.result()
    assert waited and metrics["policy_version"] == sent["version"] == 1 and sent["verified"] == 1


def test_the_policy_gathered_in_small_chunks_of_rows_is_the_same(tiny_ckpt, device, monkeypatch):
    from rlactors.trainer import core as core_module
    from rlactors.trainer.gather import row_chunks

    core = make_core(tiny_ckpt, device)
    whole = core.full_weights(torch.bfloat16)
    params = dict(core.model.named_parameters())
    chunks = row_chunks(params, 2, 1000)
    # in order, every row once, each chunk within 1000 bytes unless one row is larger
    assert [part for chunk in chunks for part in chunk][0][:2] == (next(iter(params)), 0)
    assert {name: sum(rows for chunk in chunks for n, _, rows in chunk if n == name) for name in params} == \
        {name: p.shape[0] for name, p in params.items()}
    assert all(sum(rows * 2 * math.prod(params[n].shape[1:]) for n, _, rows in chunk) <= 1000 or len(chunk) == 1
               for chunk in chunks)
    monkeypatch.setattr(core_module, "GATHER_CHUNK_BYTES", 1000)
    chunked = core.full_weights(torch.bfloat16)
    assert list(chunked) == list(whole) and all(torch.equal(chunked[n], whole[n]) for n in whole)
    assert all(t.device.type == "cpu" for t in chunked.values())
