"""The GPU path as a system, on the device machines: FSDP2/NCCL trainer -> NCCL weight sync ->
vLLM replicas, checksum verification, trainer-vs-vLLM logprob parity, a tensor-parallel replica,
alphabet_sort steps with vLLM generators. Skipped without CUDA and vLLM; tests needing 2+ GPUs
skip on fewer."""

from __future__ import annotations

import asyncio

import pytest
import torch
from support.gpus import gpus
from support.vllm_checks import NEEDS_VLLM_GPU, vllm_run_config

from rlactors.models.tiny import make_tiny_checkpoint
from rlactors.procs.placement import expandable_segments
from rlactors.run.controller import Controller
from rlactors.types import SamplingParams

pytestmark = NEEDS_VLLM_GPU


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("gpu_ckpt"), size="small", seed=0, dtype="bfloat16")


def _config(ckpt, run_dir, *extra):
    return vllm_run_config(ckpt, run_dir, 'generator.update_mode="hot_swap"', "controller.steps=2", *extra)


async def _with_controller(config, body):
    controller = Controller(config)
    try:
        await controller.start()
        return await body(controller)
    finally:
        await controller.shutdown()


@gpus(2)
def test_nccl_weight_sync_reaches_every_replica_and_is_verified(ckpt, tmp_path):
    replicas = min(2, torch.cuda.device_count() - 1)
    config = _config(ckpt, tmp_path, "trainer.ranks=1", f"generator.replicas={replicas}")

    async def updates(controller):
        return [r["engine"]["updates"] for r in (await controller.router.stats.call_one())["replicas"]]

    async def sync_and_wait(controller):
        done = [n + 1 for n in await updates(controller)]
        await controller.push_weights(controller.policy_version)  # returns once verified; the load follows
        while await updates(controller) != done:
            await asyncio.sleep(0.01)

    async def body(controller):
        prompt = list(range(5, 40))
        sampling = SamplingParams(max_tokens=16, temperature=0.0)
        before = await controller.generate(prompt, sampling, "before")
        # Other weights in the trainer (a checkpoint of another seed), then a sync: vLLM's
        # load_weights, which proves the copy plan.
        other = make_tiny_checkpoint(tmp_path / "other", size="small", seed=1, dtype="bfloat16")
        await controller.trainer.load_checkpoint.call(str(other))
        await sync_and_wait(controller)
        after = await controller.generate(prompt, sampling, "after")
        # Back to the first weights, loaded by the copy plan: the same greedy tokens as vLLM's own load.
        await controller.trainer.load_checkpoint.call(str(ckpt))
        await sync_and_wait(controller)
        back = await controller.generate(prompt, sampling, "back")
        stats = await controller.router.stats.call_one()
        # A broadcast of another version than the replicas expect is refused by every replica,
        # which keep serving what they had.
        sent, refused = await asyncio.gather(controller.trainer.send_weights.call(0),
                                             controller.router.receive_weights.call_one(7, "hot_swap"),
                                             return_exceptions=True)
        again = await controller.generate(prompt, sampling, "again")
        return before, after, back, again, stats, sent.item(gpus=0), refused

    before, after, back, again, stats, sent, refused = asyncio.run(_with_controller(config, body))
    assert before.token_ids != after.token_ids
    assert back.token_ids == before.token_ids == again.token_ids and set(again.versions) == {0}
    assert "rejected" in str(refused) and "weights version 7 expected, the broadcast carried version 0" in str(refused)
    assert sent["version"] == 0 and 0 < sent["pack_s"] <= sent["send_device_s"] <= sent["send_s"]
    assert stats["states"]["serving"] == replicas
    # A lone replica's chunks go by copy engine, unless its process grows expandable segments.
    assert sent["copy_engine"] == (1.0 if replicas == 1 and not expandable_segments() else 0.0)
    assert [r["version"] for r in stats["replicas"]] == [0] * replicas
    assert all(r["engine"]["last_update"]["copy_plan"] == 1.0 for r in stats["replicas"])


@gpus(2)
def test_two_gpu_trainer_gathers_the_policy_bitwise(ckpt, tmp_path):
    """The NCCL gather of the FSDP shards (one gather for all parameters) against the checkpoint."""
    from monarch.actor import this_host

    from rlactors.actors.trainer import spawn_trainer
    from rlactors.config import ModelConfig, TrainerConfig
    from rlactors.models.checkpoint import load_state_dict
    from rlactors.on_policy.sides import sides

    async def main():
        procs, trainer, _ = await spawn_trainer(this_host(), ModelConfig(path=str(ckpt), dtype="bfloat16"),
                                                TrainerConfig(ranks=2), sides(False, "native", "cuda").trainer,
                                                device="cuda")
        try:
            return (await trainer.state_dict_for_sync.call("bfloat16")).item(gpus=0)
        finally:
            await procs.stop()

    weights = asyncio.run(main())
    expected = load_state_dict(ckpt)
    assert set(weights.weights) == set(expected)
    for name, tensor in weights.weights.items():
        assert torch.equal(tensor, expected[name].to(torch.bfloat16)), name


@gpus(2)
def test_trainer_and_vllm_logprobs_agree_on_the_same_completions(ckpt, tmp_path):
    config = _config(ckpt, tmp_path)
    history = asyncio.run(Controller(config).run())
    for m in history:
        # bf16 vLLM vs bf16-compute FSDP trainer on identical weights.
        assert m["loss/logprob_diff/mean"] < 0.05, m
        assert m["loss/mismatch_kl/mean"] < 0.01, m
    assert [m["policy/version"] for m in history] == [1.0, 2.0]
    assert all(m["weight_sync/bytes"] > 0 for m in history)


@gpus(2)
def test_true_on_policy_over_nccl_gives_bitwise_equal_logprobs_on_every_step(ckpt, tmp_path):
    """The trainer on GPU 0, a true on-policy vLLM replica on GPU 1, weights synced by NCCL
    broadcast: the trainer's logprobs equal vLLM's on every step, also after the syncs."""
    config = _config(ckpt, tmp_path, "model.true_on_policy=true", "controller.steps=4", "controller.mode=async")
    history = asyncio.run(Controller(config).run())
    assert [m["policy/version"] for m in history] == [1.0, 2.0, 3.0, 4.0]
    assert [m["loss/logprob_diff/max"] for m in history] == [0.0] * 4, history


@gpus(4)
def test_alphabet_sort_steps_on_two_trainer_gpus_and_two_vllm_replicas(ckpt, tmp_path):
    config = _config(ckpt, tmp_path, "trainer.ranks=2", "generator.replicas=2", "controller.mode=async")
    history = asyncio.run(Controller(config).run())
    assert [m["policy/version"] for m in history] == [1.0, 2.0]
    assert all(m["generator/serving_replicas"] == 2 and m["rollout/rollouts"] == 16 for m in history)


@gpus(2)
def test_a_tensor_parallel_vllm_replica_trains_colocated_on_two_gpus(ckpt, tmp_path):
    """generator.tp=2 in default mode: one vLLM replica over GPUs 0 and 1, the trainer on GPU 0."""
    config = _config(ckpt, tmp_path, "controller.colocate=true", "generator.tp=2")
    history = asyncio.run(Controller(config).run())
    assert [m["policy/version"] for m in history] == [1.0, 2.0]
    assert all(m["rollout/rollouts"] == 16 and m["loss/logprob_diff/mean"] < 0.05 for m in history), history


def test_colocated_single_gpu_run(ckpt, tmp_path):
    config = _config(ckpt, tmp_path, "controller.colocate=true")
    history = asyncio.run(Controller(config).run())
    assert [m["policy/version"] for m in history] == [1.0, 2.0]
