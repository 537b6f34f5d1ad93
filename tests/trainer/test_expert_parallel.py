"""Expert parallelism (trainer.expert_parallel): the experts stay sharded by expert, outside FSDP;
on real gloo procs a step is the step of FSDP alone, over all 2 ranks (true on-policy mode) and
in 2 groups of 2 of 4 ranks (default mode with routing replay), also when one rank's experts get
no token; a checkpoint resumes bitwise. On 2 GPUs (NCCL, bf16 compute) the 2-rank step is FSDP's
bit for bit too."""

import asyncio
from dataclasses import replace

import pytest
import torch
from monarch.actor import this_host
from support.gpus import gpus
from support.trainer_inputs import cat, one_rank_process_group, rows
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from rlactors.actors.trainer import forward_backward, spawn_trainer
from rlactors.config import LossConfig, ModelConfig, TrainerConfig
from rlactors.models.checkpoint import fuse_experts, load_args, load_state_dict
from rlactors.models.moe import Experts
from rlactors.on_policy.sides import sides
from rlactors.procs.placement import first_value
from rlactors.trainer.batch import MicroBatch
from rlactors.trainer.expert_parallel import expert_mesh, shared_cast
from rlactors.trainer.losses import LossNorm
from rlactors.trainer.parallel import build_sharded_model, held_rows, local_rows, make_mesh

LOSS = LossConfig(name="dapo", clip_high=0.28)


def logprobs_and_grads(ckpt, mb, device, expert_parallel):
    """One forward and backward of a sharded tiny MoE over the one-rank group: the logprobs, every
    gradient, and what each Experts module held while it computed."""
    args = load_args(ckpt)
    weights = fuse_experts(load_state_dict(ckpt), args)
    model = build_sharded_model(args, make_mesh(device), device, mixed_precision=False, activation_checkpointing=False,
                                compile_layers=False, expert_mesh=expert_mesh("cpu", 1) if expert_parallel else None)
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
    assert len(ep_seen) == 3
    assert all(isinstance(p, DTensor) and p.placements == (Replicate(), Shard(0)) for p in ep_seen)
    assert not any(isinstance(p, DTensor) for p in fsdp_seen)  # FSDP gathers them for the forward
    assert torch.equal(ep_logprobs, fsdp_logprobs)
    assert fsdp_grads.keys() == ep_grads.keys()
    assert all(torch.equal(ep_grads[n], fsdp_grads[n]) for n in fsdp_grads)


def test_held_rows_are_a_dim_0_shard_and_other_placements_are_refused():
    weight = torch.arange(12.0).view(3, 4)
    with one_rank_process_group("cpu"):
        mesh = expert_mesh("cpu", 1)
        assert held_rows(distribute_tensor(weight, mesh, [Replicate(), Shard(0)])) == [(0, 3)]
        for placements in ([Replicate(), Shard(1)], [Shard(0), Shard(0)]):
            with pytest.raises(ValueError, match=r"^expected a parameter sharded on dim 0 over one mesh dim"):
                held_rows(distribute_tensor(weight, mesh, placements))


def test_uses_of_a_shared_cast_add_their_gradients_in_the_weights_dtype():
    """Two uses of one bf16 copy of an fp32 weight, whose gradients 1 and 2**-9 add to 1 in bf16:
    the weight's gradient is their fp32 sum, as FSDP's fp32 reduction adds two ranks' bf16
    gradients."""
    weight = torch.ones(3, requires_grad=True)
    cast = weight.detach().to(torch.bfloat16)
    uses = [shared_cast(weight, cast) for _ in range(2)]
    assert all(u.dtype == torch.bfloat16 and u.data_ptr() == cast.data_ptr() for u in uses)
    (uses[0].sum() + (uses[1] * 2 ** -9).sum()).backward()
    assert weight.grad.dtype == torch.float32
    assert torch.equal(weight.grad, torch.full((3,), 1 + 2 ** -9))


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


async def trained(model, config, batches, checkpoint_root=None, microbatches=1, device="cpu"):
    """Each step on ``config.ranks`` spawned trainer ranks on ``device`` (on CUDA one GPU each), a
    batch's rows split evenly over them and a rank's rows into ``microbatches``: the logprobs
    before it, its metrics and the weights after it; with ``checkpoint_root``, also the weights
    after resuming from a checkpoint of step 1 and taking the last step again."""
    procs, trainer, _ = await spawn_trainer(this_host(), model, config,
                                            sides(model.true_on_policy, "native", device).trainer, device=device)

    async def step(batch):
        share = len(batch) // config.ranks
        ranks_rows = [batch[r * share:(r + 1) * share] for r in range(config.ranks)]
        logprobs = await trainer.compute_logprobs.call([cat(r) for r in ranks_rows])
        size = share // microbatches
        split = [[cat(r[i:i + size]) for i in range(0, share, size)] for r in ranks_rows]
        await forward_backward(trainer, split, LossNorm.for_step(batch, LOSS.name), LOSS)
        metrics = first_value(await trainer.optim_step.call())
        weights = first_value(await trainer.state_dict_for_sync.call("float32")).weights
        return [logprobs.item(gpus=r) for r in range(config.ranks)], metrics, weights

    try:
        steps = []
        for i, batch in enumerate(batches):
            steps.append(await step(batch))
            if checkpoint_root and i == 0:
                saved = (await trainer.save_checkpoint.call(str(checkpoint_root), 1)).item(gpus=0)
        if not checkpoint_root:
            return steps, None
        await trainer.load_checkpoint.call(saved)
        return steps, (await step(batches[-1]))[2]
    finally:
        await procs.stop()


def assert_weights_equal(actual, expected, names=None):
    assert actual.keys() == expected.keys()
    assert all(torch.equal(actual[n], expected[n]) for n in names or expected)


def assert_all_ranks_expert_parallel_steps_bitwise_as_fsdp_alone(loop, family_ckpt, tmp_path, device):
    """Two steps on 2 ranks on ``device`` with trainer.expert_parallel 2 and 1, in true on-policy
    mode: the same logprobs, loss, gradient norm and weights, bit for bit; resuming the
    expert-parallel ranks from a checkpoint of step 1 repeats step 2 bit for bit."""
    ckpt, batches = family_ckpt("qwen3_moe", tie=False), [rows(5), rows(6)]
    model = ModelConfig(path=str(ckpt), true_on_policy=True)
    config = TrainerConfig(ranks=2, lr=1e-2, max_grad_norm=0.005)
    fsdp_steps, _ = loop.run_until_complete(trained(model, config, batches, device=device))
    ep_steps, resumed = loop.run_until_complete(
        trained(model, replace(config, expert_parallel=2), batches, tmp_path, device=device))
    for (fsdp_logprobs, fsdp_metrics, fsdp_weights), (ep_logprobs, ep_metrics, ep_weights) in zip(fsdp_steps, ep_steps):
        assert all(torch.equal(a, b) for a, b in zip(ep_logprobs, fsdp_logprobs))
        for key in ("loss", "grad_norm", "logprob_diff/max"):
            assert ep_metrics[key] == fsdp_metrics[key], key
        assert_weights_equal(ep_weights, fsdp_weights)
    assert fsdp_steps[1][1]["policy_version"] == 2
    assert_weights_equal(resumed, ep_steps[1][2])


def test_all_ranks_expert_parallel_steps_bitwise_as_fsdp_alone(loop, family_ckpt, tmp_path):
    """On 2 gloo CPU ranks, fp32 throughout: each rank holds the expert rows FSDP gives it, and an
    expert's gradient sums 2 terms, exact in any order."""
    assert_all_ranks_expert_parallel_steps_bitwise_as_fsdp_alone(loop, family_ckpt, tmp_path, "cpu")


@gpus(2)
def test_all_ranks_expert_parallel_steps_bitwise_as_fsdp_alone_on_two_gpus(loop, family_ckpt, tmp_path):
    """On 2 GPUs (NCCL all-to-alls, bf16 compute from fp32 master weights, Triton batch-invariant
    kernels forward, torch's grouped GEMMs backward), also bit for bit:
    - a row's expert output does not depend on the rows beside it (the batch-invariant grouped
      launch), so computing a source rank's rows on the rank holding their experts changes none;
    - the grouped GEMMs of the backward sum each expert's rows of one source rank with the same
      CUTLASS tile whether the launch also holds the other experts' rows (FSDP) or not: torch
      takes its small tile whenever a matrix side is at most 128, as this model's (64 and 128)
      always are (in a wider model the mean rows per expert may pick another tile);
    - an expert's gradient is the fp32 sum of 2 ranks' bf16 terms on both sides (FSDP's fp32
      reduce-scatter; expert parallelism's ``shared_cast``), exact in either order.
    Runs on the first two GPUs that CUDA_VISIBLE_DEVICES names (``scripts/gpu_suite.py 2gpu``)."""
    assert_all_ranks_expert_parallel_steps_bitwise_as_fsdp_alone(loop, family_ckpt, tmp_path, "cuda")


# Under trainer.expert_parallel 2 of 4 ranks, ranks 0 and 2 hold experts 0-3 of the tiny MoE (8
# experts, 3 sparse layers, top 2), ranks 1 and 3 experts 4-7. Rank r's tokens go to experts
# REPLAYED[r] in every sparse layer: an expert gets the rows of at most one rank of each
# expert-parallel group (0 and 1, 2 and 3), and no rank of the second group sends rows to experts
# 4-7, so rank 3 computes none.
REPLAYED = [(4, 0), (5, 1), (2, 0), (3, 1)]


def replayed(mb: MicroBatch, experts: tuple[int, int]) -> MicroBatch:
    routed = torch.tensor(experts).expand(*mb.input_ids.shape, 3, 2).clone()
    return MicroBatch(**{**vars(mb), "routed_experts": routed})


def test_two_groups_of_two_expert_parallel_ranks_step_as_fsdp_alone(loop, family_ckpt, tmp_path):
    """Two steps on 4 ranks with trainer.expert_parallel 2 and 1, in default mode with routing
    replay, 2 microbatches a rank (gradient accumulation), no gradient clipped.

    Step 1 replays REPLAYED: an expert's gradient sums the terms of at most 2 ranks (the others
    are 0), which is exact in any order, so the logprobs, loss and weights after the step, expert
    tensors gathered in full for sync, are FSDP's bit for bit. Step 2 routes by the routers: an
    expert's gradient may sum the terms of all 4 ranks, FSDP's reduce-scatter in gloo's order and
    expert parallelism as (rank 0 + rank 1) + (rank 2 + rank 3), so the experts' weights after it
    are FSDP's up to that rounding (the other weights still bit for bit). The gradient norm sums
    squares of the rows each rank holds, 2 experts of each expert tensor under FSDP and 4 under
    expert parallelism, so its fp32 sums run in another order: equal to a few units in the last
    place. No gradient is clipped, as a clip scale from such norms would differ in its last bits.
    Resuming the expert-parallel ranks from a checkpoint of step 1 repeats step 2 bit for bit."""
    ckpt = family_ckpt("qwen3_moe", tie=False)
    batches = [[replayed(mb, REPLAYED[i // 2]) for i, mb in enumerate(rows(5))], rows(6)]
    model = ModelConfig(path=str(ckpt), routing_replay=True)
    config = TrainerConfig(ranks=4, lr=1e-2, max_grad_norm=1e6)
    fsdp_steps, _ = loop.run_until_complete(trained(model, config, batches, microbatches=2))
    ep_steps, resumed = loop.run_until_complete(
        trained(model, replace(config, expert_parallel=2), batches, tmp_path, microbatches=2))
    for (fsdp_logprobs, fsdp_metrics, _), (ep_logprobs, ep_metrics, _) in zip(fsdp_steps, ep_steps):
        assert all(torch.equal(a, b) for a, b in zip(ep_logprobs, fsdp_logprobs))
        for key in ("loss", "expert_mismatch/share"):
            assert ep_metrics[key] == fsdp_metrics[key], key
        assert ep_metrics["grad_norm"] == pytest.approx(fsdp_metrics["grad_norm"], rel=1e-6, abs=0)
    assert fsdp_steps[0][1]["expert_mismatch/share"] > 0.5  # the replayed experts are not the routers'
    (_, _, fsdp_weights), (_, _, ep_weights) = fsdp_steps[0], ep_steps[0]
    assert_weights_equal(ep_weights, fsdp_weights)
    (_, _, fsdp_weights), (_, _, ep_weights) = fsdp_steps[1], ep_steps[1]
    experts = {n for n in fsdp_weights if ".mlp.experts." in n}
    assert len(experts) == 6  # the experts' gate_up_proj and down_proj, 3 sparse layers
    assert_weights_equal(ep_weights, fsdp_weights, fsdp_weights.keys() - experts)
    for n in experts:
        # Adam moves a weight by lr * m / (sqrt(v) + eps): a gradient a few units in its last place
        # off moves it by some 1e-7 * lr more or less, more where the ranks' terms of the gradient
        # nearly cancel (seen: up to 2.6e-6 * lr); lr * 1e-4 leaves room for 40 times more.
        torch.testing.assert_close(ep_weights[n], fsdp_weights[n], rtol=0, atol=config.lr * 1e-4, msg=n)
    assert_weights_equal(resumed, ep_steps[1][2])
