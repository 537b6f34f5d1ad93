"""BroadcastSync's decisions against stand-ins for the trainer and the router: what a push does
when the members of its group die while the broadcast runs. (The protocol with real procs and
real groups: tests/faults/test_training_faults.py on CPU, tests/faults/test_nccl_faults.py on GPUs.)"""

from __future__ import annotations

import asyncio

import pytest

from rlactors.weight_sync.sync import BroadcastStuck, BroadcastSync, NoReplicaUp


class Rank0:
    """A whole-mesh call's result with one point (what `first_value` reads)."""

    extent = {"gpus": 1}

    def __init__(self, value):
        self.value = value

    def item(self, **_):
        return self.value


class Call:
    def __init__(self, result, seconds=0.0):
        self.result, self.seconds = result, seconds

    async def _run(self, *_):
        await asyncio.sleep(self.seconds)
        return self.result

    def call(self, *args):
        return self._run(*args)

    call_one = call


class Trainer:
    def __init__(self, broadcast_s):
        self.pack_weights = Call(Rank0({"version": 1, "checksum": "c", "pack_s": 0.1, "checksum_s": 0.1}))
        self.broadcast_weights = Call(Rank0({"bytes": 8.0, "broadcast_s": 0.1}), broadcast_s)


class Router:
    def __init__(self, received, dead):
        self.plan_weight_group = Call({"members": [0], "stale": False, "world_size": 2})
        self.receive_weights = Call({"version": 1, "replicas": received})
        self.dead_weight_group_members = Call(dead)


def push(trainer, router):
    return asyncio.run(BroadcastSync(trainer, router, "bfloat16", "hot_swap").push())


def test_a_push_that_every_member_died_during_raises_no_replica_up():
    """NCCL may let the sender finish a broadcast its buffers hold whole, with no one receiving."""
    with pytest.raises(NoReplicaUp, match=r"replica\(s\) \[0\] died during the broadcast, and no replica is up"):
        push(Trainer(broadcast_s=0.0), Router(received=[], dead=[0]))


def test_a_broadcast_that_outlives_a_dead_member_is_given_up_as_stuck(monkeypatch):
    monkeypatch.setattr("rlactors.weight_sync.sync.BROADCAST_WATCH_S", 0.01)
    monkeypatch.setattr("rlactors.weight_sync.sync.BROADCAST_DEATH_GRACE_S", 0.05)
    with pytest.raises(BroadcastStuck, match=r"replica\(s\) \[0\] died during the broadcast, which waits"):
        push(Trainer(broadcast_s=5.0), Router(received=[], dead=[0]))


def test_a_push_that_a_member_received_completes():
    timings = push(Trainer(broadcast_s=0.0), Router(received=[{"receive_verify_s": 0.2}], dead=[]))
    assert timings["bytes"] == 8.0 and timings["replica_receive_verify_s"] == 0.2


@pytest.mark.parametrize("stale", [False, True])
def test_a_push_is_due_for_a_new_version_or_for_a_replica_that_waits_for_weights(stale):
    router = Router(received=[], dead=[])
    router.plan_weight_group = Call({"members": [0], "stale": stale, "world_size": 2})
    weights = BroadcastSync(Trainer(broadcast_s=0.0), router, "bfloat16", "hot_swap")
    assert asyncio.run(weights.due(1))  # version 0 was pushed last
    assert asyncio.run(weights.due(0)) == stale  # a restarted member, or a dead one, makes the group stale
