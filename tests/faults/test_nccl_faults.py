"""Generator replicas killed around a weight sync over NCCL, on two GPUs: the trainer on GPU 0,
one vLLM replica on GPU 1, weights broadcast by NCCL; killed between syncs or during a broadcast,
with and without `generator.restart_dead`. The CPU suite shows the same protocol over
gloo (test_training_faults.py); here NCCL's own waiting is real. Needs 2 GPUs and vLLM."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from faultkit import kill_replica
from support.stand_ins import ActorWith
from support.vllm_checks import NEEDS_VLLM_GPU, vllm_run_config

from rlactors.models.tiny import make_tiny_checkpoint
from rlactors.run.controller import Controller, TrainingError

pytestmark = [*NEEDS_VLLM_GPU, pytest.mark.two_gpus,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("nccl_ckpt"), size="small", seed=0, dtype="bfloat16")


def nccl_config(ckpt, run_dir, *extra):
    return vllm_run_config(ckpt, run_dir, 'generator.weight_sync="broadcast"', "controller.steps=3",
                           "controller.checkpoint_every=0", *extra)


class ReplicaKilledBetweenSyncs(Controller):
    """SIGKILLs the replica as step 1's optimizer step goes out, before its weight sync; records how long the
    router took to count it dead and to have its restart up, then lets the sync go on."""

    async def push_weights(self, version):
        if version == 1:
            killed = await kill_replica(self.router, 0)
            while (await self.router.stats.call_one())["deaths"] != 1:
                assert time.monotonic() - killed < 30, "the router did not count the replica dead"
                await asyncio.sleep(0.05)
            self.detection_s = time.monotonic() - killed
            while (await self.router.plan_weight_group.call_one())["members"] != [0]:
                assert time.monotonic() - killed < 300, "the replica was not restarted"
                await asyncio.sleep(0.1)
            self.restart_s = time.monotonic() - killed
        timings = await super().push_weights(version)
        await self.weight_sync.settled()  # the router has recorded the push
        self.router_stats = await self.router.stats.call_one()
        return timings


def test_a_replica_killed_between_nccl_syncs_is_restarted_into_a_new_group(ckpt, tmp_path, fault_record):
    controller = ReplicaKilledBetweenSyncs(nccl_config(ckpt, tmp_path, "generator.restart_dead=true"))
    metrics = asyncio.run(controller.run())
    assert [m["policy/version"] for m in metrics] == [1.0, 2.0, 3.0]
    stats = controller.router_stats
    assert stats["deaths"] == 1 and stats["restarts"] == 1 and stats["weight_groups"] == 2
    assert [(r["state"], r["version"]) for r in stats["replicas"]] == [("serving", 3)]
    assert controller.detection_s <= 3, controller.detection_s
    fault_record("generator replica SIGKILLed between NCCL weight syncs",
                 "the only replica's proc, as step 1's optimizer step goes out, before its NCCL broadcast",
                 controller.detection_s, "nothing: the restarted replica joined a new NCCL group and received "
                 "step 1's weights; 3/3 steps trained", restart_s=controller.restart_s)


class ReplicaKilledDuringBroadcast(Controller):
    """SIGKILLs the replica as the trainer's first NCCL broadcast starts (the replica may or may
    not have entered it), then lets the real broadcast run; later broadcasts just run. Records
    the router's stats after each sync."""

    killed_at = None

    async def start(self) -> None:
        await super().start()
        trainer, controller = self.trainer, self

        class Broadcast:
            def call(self, version):
                async def kill_then_broadcast():
                    if controller.killed_at is None:
                        controller.killed_at = await kill_replica(controller.router, 0)
                    return await trainer.send_weights.call(version)
                return kill_then_broadcast()

        self.trainer = self.weight_sync.trainer = ActorWith(trainer, send_weights=Broadcast())

    async def push_weights(self, version):
        try:
            timings = await super().push_weights(version)
        finally:
            self.given_up_at = time.monotonic()
        await self.weight_sync.settled()  # the router has recorded the push
        self.router_stats = await self.router.stats.call_one()
        return timings


def test_a_replica_killed_during_an_nccl_broadcast_stops_the_run_naming_it(ckpt, tmp_path, fault_record):
    controller = ReplicaKilledDuringBroadcast(nccl_config(ckpt, tmp_path, "generator.restart_dead=false"))
    start = time.monotonic()
    with pytest.raises(TrainingError) as raised:
        asyncio.run(asyncio.wait_for(controller.run(), 240))  # a regression hangs: fail instead
    stopped_s = controller.given_up_at - controller.killed_at
    # The trainer waits for the dead member's verdict, so it is stuck in the collective.
    assert str(raised.value) == ("weight sync of policy version 1: generator replica(s) [0] died during the "
                                 "broadcast, which waits for every member; no checkpoint was completed; continue "
                                 "with --resume")
    assert stopped_s < 10, stopped_s
    fault_record("generator replica SIGKILLed during an NCCL broadcast",
                 "the only replica's proc, as step 1's NCCL broadcast starts", None,
                 f"step 1's update: the sync gave up {stopped_s:.1f} s after the kill and the run stopped with the "
                 f"documented line (whole run, shutdown included: {time.monotonic() - start:.0f} s)")


def test_a_replica_killed_during_an_nccl_broadcast_with_restart_dead_is_restarted_into_a_new_group(
        ckpt, tmp_path, fault_record):
    controller = ReplicaKilledDuringBroadcast(nccl_config(ckpt, tmp_path, "generator.restart_dead=true"))
    metrics = asyncio.run(asyncio.wait_for(controller.run(), 540))  # a regression hangs: fail instead
    assert [m["policy/version"] for m in metrics] == [1.0, 2.0, 3.0]
    # Step 1's broadcast was stuck on the dead member's verdict and aborted; it went again, to a
    # group of the restarted replica (waited for).
    assert [m["weight_sync/broadcast_tries"] for m in metrics] == [2.0, 1.0, 1.0]
    stats = controller.router_stats
    assert stats["deaths"] == 1 and stats["restarts"] == 1 and stats["weight_groups"] == 2
    assert [(r["state"], r["version"]) for r in stats["replicas"]] == [("serving", 3)]
    recovered_s = metrics[0]["time/weight_sync_s"]  # step 1's push, from its optimizer step to its return
    fault_record("generator replica SIGKILLed during an NCCL broadcast (generator.restart_dead)",
                 "the only replica's proc, as step 1's NCCL broadcast starts", None,
                 f"nothing: step 1's push went again to a new group of the restarted replica ({recovered_s:.1f} s "
                 "of weight sync, the restart included); 3/3 steps trained", recovered_s=recovered_s)
