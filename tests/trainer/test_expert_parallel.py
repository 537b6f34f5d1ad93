"""Expert parallelism (trainer.expert_parallel): the experts stay sharded by expert, outside FSDP,
and on 2 real gloo procs a step is bitwise the step of FSDP alone, in true on-policy mode and in
default mode with routing replay, also when one rank's experts get no token; a checkpoint resumes
bitwise."""

import asyncio

import pytest
import torch
from monarch.actor import this_host
from support.trainer_inputs import cat, one_rank_process_group, rows
from torch.distributed.tensor import DTensor, Shard

from rlactors.actors.trainer import spawn_trainer, train_step
from rlactors.config import LossConfig, ModelConfig, TrainerConfig
from rlactors.losses import LossNorm
from rlactors.models.checkpoint import fuse_experts, load_args, load_state_dict
from rlactors.models.moe import Experts
from rlactors.on_policy.sides import sides
from rlactors.placement import first_value
from rlactors.trainer.batch import MicroBatch
from rlactors.trainer.parallel import build_sharded_model, local_rows, make_mesh

LOSS = LossConfig(name="dapo", clip_high=0.28)


def logprobs_and_grads(ckpt, mb, device, expert_parallel):
    """One forward and backward of a sharded tiny MoE over the one-rank group: the logprobs, every
    gradient, and what each Experts module held while it computed."""
    args = load_args(ckpt)
    weights = fuse_experts(load_state_dict(ckpt), args)
    model = build_sharded_model(args, make_mesh(device), device, mixed_precision=False, activation_checkpointing=False,
                                compile_layers=False, expert_parallel=expert_parallel)
    with torch.no_grad():
        for name, param in model.named_parameters():
            local, first = local_rows(param)
            local.copy_(weights[name][first:first + local.shape[0]])
    seen = []
    for module in model.modules():
        if isinstance(module, Experts):
            module.register_forward_pre_hook(lambda m, _: seen.append(m.gate_up_proj))
    positions = mb.positions.reshape(-1)
    hidden = model(mb.input_ids.reshape(-1), positions, sides(False, "native", device).trainer.attention(positions))
    logprobs = model.token_logprobs(hidden, mb.target_ids.reshape(-1))
    logprobs[mb.loss_mask.reshape(-1)].sum().backward()
    return logprobs.detach(), {n: p.grad.full_tensor() for n, p in model.named_parameters()}, seen


def test_experts_stay_sharded_outside_fsdp_and_compute_what_fsdp_does(family_ckpt):
    ckpt, mb = family_ckpt("qwen3_moe"), cat(rows(5)[:2])
    with one_rank_process_group("cpu") as device:
        results = [logprobs_and_grads(ckpt, mb, device, expert_parallel) for expert_parallel in (False, True)]
    (fsdp_logprobs, fsdp_grads, fsdp_seen), (ep_logprobs, ep_grads, ep_seen) = results
    assert len(ep_seen) == 3 and all(isinstance(p, DTensor) and p.placements == (Shard(0),) for p in ep_seen)
    assert not any(isinstance(p, DTensor) for p in fsdp_seen)  # FSDP gathers them for the forward
    assert torch.equal(ep_logprobs, fsdp_logprobs)
    assert fsdp_grads.keys() == ep_grads.keys()
    assert all(torch.equal(ep_grads[n], fsdp_grads[n]) for n in fsdp_grads)


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def to_rank_0_experts(mb: MicroBatch) -> MicroBatch:
    """``mb`` whose every token the generator, at policy version 1, routed to experts 0 and 1 in
    every sparse layer (rank 0's under 2-way expert parallelism)."""
    routed = torch.tensor([0, 1]).expand(*mb.input_ids.shape, 3, 2).clone()  # tiny MoE: 3 sparse layers, top 2
    return MicroBatch(**{**vars(mb), "routed_experts": routed, "versions": torch.where(mb.loss_mask, 1, -1)})


@pytest.mark.parametrize("mode", ["true_on_policy", "routing_replay"])
def test_two_expert_parallel_ranks_step_bitwise_as_fsdp_alone(loop, family_ckpt, tmp_path, mode):
    """Two steps on 2 ranks with trainer.expert_parallel 2 and 1: the same logprobs, loss, gradient
    norm and weights, bit for bit; resuming the expert-parallel ranks from a checkpoint of step 1
    repeats step 2 bit for bit. With routing replay the second step sends every token to rank
    0's experts, so rank 1's get none (a zero gradient, as under FSDP)."""
    ckpt, batches = family_ckpt("qwen3_moe", tie=False), [rows(5), rows(6)]
    if mode == "routing_replay":
        batches[1] = [to_rank_0_experts(mb) for mb in batches[1]]
    model = ModelConfig(path=str(ckpt), true_on_policy=mode == "true_on_policy",
                        routing_replay=mode == "routing_replay")

    async def step(trainer, batch):
        split = [[cat(batch[:3])], [cat(batch[3:])]]
        logprobs = await trainer.compute_logprobs.call([s[0] for s in split])
        metrics = await train_step(trainer, split, LossNorm.for_step(batch, LOSS.name), LOSS)
        return [logprobs.item(gpus=r) for r in range(2)], metrics

    async def weights(trainer):
        return first_value(await trainer.state_dict_for_sync.call("float32")).weights

    async def trained(expert_parallel):
        """Both steps, the weights after them, and (expert parallel) those after resuming from a
        checkpoint of step 1 and taking step 2 again."""
        config = TrainerConfig(ranks=2, lr=1e-2, max_grad_norm=0.005, expert_parallel=expert_parallel)
        procs, trainer, _ = await spawn_trainer(this_host(), model, config,
                                                sides(model.true_on_policy, "native", "cpu").trainer)
        try:
            steps = [await step(trainer, batches[0])]
            if expert_parallel > 1:
                saved = (await trainer.save_checkpoint.call(str(tmp_path), 1)).item(gpus=0)
            steps.append(await step(trainer, batches[1]))
            final = await weights(trainer)
            if expert_parallel == 1:
                return steps, final, None
            await trainer.load_checkpoint.call(saved)
            await step(trainer, batches[1])
            return steps, final, await weights(trainer)
        finally:
            await procs.stop()

    fsdp_steps, fsdp_weights, _ = loop.run_until_complete(trained(1))
    ep_steps, ep_weights, resumed_weights = loop.run_until_complete(trained(2))
    for (fsdp_logprobs, fsdp_metrics), (ep_logprobs, ep_metrics) in zip(fsdp_steps, ep_steps):
        assert all(torch.equal(a, b) for a, b in zip(ep_logprobs, fsdp_logprobs))
        for key in ("loss", "grad_norm", "logprob_diff/max", "expert_mismatch/share"):
            assert ep_metrics[key] == fsdp_metrics[key], key
    assert fsdp_steps[1][1]["policy_version"] == 2
    assert ep_weights.keys() == fsdp_weights.keys()
    assert all(torch.equal(ep_weights[n], fsdp_weights[n]) for n in fsdp_weights)
    assert all(torch.equal(resumed_weights[n], ep_weights[n]) for n in ep_weights)
    if mode == "routing_replay":
        assert fsdp_steps[1][1]["expert_mismatch/share"] > 0.5  # the replayed experts are not the routers'
