"""The router's side of weight sync (`ReplicaWeights`) over stand-in replicas: the broadcast
group's plan, ranks and re-forming, each replica's outcome of a push (took it, rejected it, its
group broke, died), and the messages variant's latest weights that a restarted replica is
brought to. The real
router and replicas run the same object in tests/actors and tests/faults."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from monarch.actor import ActorError

from rlactors.types import EngineDeadError
from rlactors.weight_sync.broadcast import BroadcastBroken
from rlactors.weight_sync.checksum import ChecksumMismatch
from rlactors.weight_sync.replicas import ReplicaWeights


class _Endpoint:
    """One endpoint of a stand-in Generator: records its calls, answers with `answer(*args)`."""

    def __init__(self, answer):
        self.answer, self.calls = answer, []

    async def call_one(self, *args):
        self.calls.append(args)
        result = self.answer(*args)
        if isinstance(result, BaseException):
            raise result
        return result


@dataclass(eq=False)
class _Replica:
    index: int
    up: bool = True
    version: int | None = 0
    outcome: Any = None  # what a push answers: None (took it) or an exception
    actor: Any = field(init=False)

    def __post_init__(self):
        def push(*args):
            return self.outcome if self.outcome is not None else {"receive_verify_s": 0.1 * self.index}

        def join(host, port, rank_offset, world_size, layout):
            return [rank_offset]

        self.actor = type("Actor", (), {"update_weights": _Endpoint(push), "receive_weights": _Endpoint(push),
                                        "join_weight_group": _Endpoint(join)})()


def _weights(tp: int = 1) -> tuple[ReplicaWeights, list, list]:
    died, received = [], []
    weights = ReplicaWeights(tp, died=lambda r, e: died.append((r.index, type(e).__name__)),
                             received=lambda r: received.append(r.index))
    return weights, died, received


def test_a_group_is_planned_joined_with_its_ranks_and_goes_stale_when_a_member_dies_or_is_replaced():
    async def main():
        weights, _, _ = _weights(tp=2)
        replicas = [_Replica(0), _Replica(1, up=False), _Replica(2)]
        up = [r for r in replicas if r.up]
        assert weights.plan(up) == {"stale": True, "members": [0, 2], "world_size": 5, "epoch": 0}
        assert await weights.join("10.0.0.1", 29500, "layout") == 5
        # Member m's TP workers from rank 1 + m * tp on: the trainer is rank 0.
        assert replicas[0].actor.join_weight_group.calls == [("10.0.0.1", 29500, 1, 5, "layout")]
        assert replicas[2].actor.join_weight_group.calls == [("10.0.0.1", 29500, 3, 5, "layout")]
        assert replicas[1].actor.join_weight_group.calls == []
        assert weights.plan(list(up))["stale"] is False and weights.groups_formed == 1

        told = []
        weights.watch(SimpleNamespace(send=told.append))
        replicas[2].up = False  # died: the router says so
        weights.up_changed()
        assert told == [1] and weights.dead_members() == [2]
        assert weights.plan([replicas[0]]) == {"stale": True, "members": [0], "world_size": 3, "epoch": 1}
        restarted = _Replica(2)  # a new replica in the dead one's slot: a new member
        assert weights.plan([replicas[0], restarted])["stale"] is True
        await weights.join("10.0.0.1", 29501, "layout")
        assert restarted.actor.join_weight_group.calls == [("10.0.0.1", 29501, 3, 5, "layout")]
        assert weights.dead_members() == [] and weights.groups_formed == 2

    asyncio.run(main())


def test_a_broadcast_reaches_the_members_up_and_each_takes_it_rejects_it_or_dies():
    async def main():
        weights, died, received = _weights()
        took = _Replica(0)
        rejected = _Replica(1, outcome=ActorError(ChecksumMismatch("received checksum 1, trainer sent 2")))
        dead_engine = _Replica(2, outcome=ActorError(EngineDeadError("generator engine loop died")))
        gone = _Replica(3, outcome=ConnectionError("proc gone"))
        down = _Replica(4)
        members = [took, rejected, dead_engine, gone, down]
        weights.plan(members)
        await weights.join("10.0.0.1", 29500, None)
        down.up = False
        with pytest.raises(RuntimeError) as raised:
            await weights.receive(7, "drain")
        assert str(raised.value) == ("weights version 7 rejected by replica 1: "
                                     "ChecksumMismatch('received checksum 1, trainer sent 2')")
        assert [r.version for r in members] == [7, 0, 0, 0, 0]
        assert received == [0] and died == [(2, "ActorError"), (3, "ConnectionError")]
        assert down.actor.receive_weights.calls == [] and took.actor.receive_weights.calls == [(7, "drain")]

        rejected.outcome = None
        result = await weights.receive(8, None)
        assert result["version"] == 8 and result["replicas"] == [{"receive_verify_s": 0.0}, {"receive_verify_s": 0.1}]
        assert received == [0, 0, 1]

    asyncio.run(main())


def test_a_member_whose_broadcast_group_broke_lives_on_without_the_version():
    async def main():
        weights, died, received = _weights()
        took, broken = _Replica(0), _Replica(1, outcome=ActorError(BroadcastBroken("the group broke")))
        weights.plan([took, broken])
        await weights.join("10.0.0.1", 29500, None)
        result = await weights.receive(7, None)
        assert result["broken"] == [1] and len(result["replicas"]) == 1
        assert [r.version for r in (took, broken)] == [7, 0] and died == [] and received == [0]

    asyncio.run(main())


def test_messages_keep_the_latest_weights_a_replica_took_and_bring_a_restarted_one_to_them():
    async def main():
        weights, _, _ = _weights()
        serving = [_Replica(0), _Replica(1)]
        v1, v2 = {"w": torch.ones(2)}, {"w": torch.zeros(2)}
        result = await weights.update(1, v1, "a" * 32, "drain", serving)
        assert result["replicas"] == [0, 1] and serving[0].actor.update_weights.calls == [(1, v1, "a" * 32, "drain")]

        for replica in serving:
            replica.outcome = ActorError(ValueError("weights do not match the model"))
        with pytest.raises(RuntimeError, match="weights version 2 rejected by replica 0: ValueError"):
            await weights.update(2, v2, None, None, serving)
        assert weights.latest.version == 1  # nobody took version 2: a restart comes up at version 1

        restarted = _Replica(1)
        assert await weights.bring_up(restarted) is False
        assert restarted.version == 1 and restarted.actor.update_weights.calls == [(1, v1, "a" * 32)]
        assert await weights.bring_up(restarted) is False and len(restarted.actor.update_weights.calls) == 1

        weights.plan([serving[0]])
        await weights.join("10.0.0.1", 29500, None)
        waiting = _Replica(1)
        assert await weights.bring_up(waiting) is True  # by broadcast: it waits for the next group
        assert waiting.actor.update_weights.calls == []

    asyncio.run(main())
