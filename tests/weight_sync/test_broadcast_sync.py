"""BroadcastSync's decisions against stand-ins for the trainer and the router: what a push does
when the members of its group die while the broadcast runs, with and without
`generator.restart_dead`, and which pushes go with the optimizer step. (The protocol with real procs and real groups:
tests/faults/test_training_faults.py on CPU, tests/faults/test_nccl_faults.py on GPUs.)"""

from __future__ import annotations

import asyncio
import time

import pytest
from monarch.actor import ActorError
from support.stand_ins import Rank0

from rlactors.config import load_config
from rlactors.weight_sync.broadcast import BroadcastBroken
from rlactors.weight_sync.checksum import ChecksumMismatch
from rlactors.weight_sync.sync import (
    BROADCAST_TRIES,
    BroadcastStuck,
    BroadcastSync,
    MembersDied,
    NoReplicaUp,
    WeightSyncError,
    create_weight_sync,
)


class Call:
    """An endpoint that answers each call with the next of `results` (the last one once they run
    out) after `seconds`; an exception is raised. Records its calls."""

    def __init__(self, *results, seconds=0.0):
        self.results, self.seconds, self.calls = list(results), seconds, []

    async def _run(self, *args):
        self.calls.append(args)
        result = self.results.pop(0) if len(self.results) > 1 else self.results[0]
        if callable(result):  # made at the call: timings that hold the wall clock
            result = result()
        await asyncio.sleep(self.seconds)
        if isinstance(result, BaseException):
            raise result
        return result

    def call(self, *args):
        return self._run(*args)

    call_one = call


def sent(verified=1, receivers=1):
    """The trainer's send, starting and ending when it is called (what the push's lags read):
    `verified` of its `receivers` summed a verdict of 1 (they verified the weights)."""
    now = time.time()
    return Rank0({"version": 1, "checksum": "c" * 32, "verified": verified, "receivers": receivers, "bytes": 8.0,
                  "copy_engine": 0.0, "send_s": 0.1, "send_device_s": 0.08, "pack_s": 0.05, "step_wait_s": 0.0,
                  "started_at": now, "ended_at": now})


def unverified():
    return sent(verified=0)


BROKEN = ActorError(BroadcastBroken("the weight broadcast group broke: Connection closed by peer"))


class Trainer:
    def __init__(self, *broadcasts, broadcast_s=0.0):
        self.send_weights = Call(*(broadcasts or (sent,)), seconds=broadcast_s)
        self.weight_sync_address = Call(Rank0(("10.0.0.1", 29500)))
        self.weight_layout = Call(Rank0("layout"))
        self.init_weight_sender = Call(None)
        self.abort_weight_broadcast = Call(None)


def plan(members, stale=False, restarting=(), epoch=0):
    return {"members": members, "stale": stale, "world_size": 1 + len(members), "restarting": list(restarting),
            "epoch": epoch}


def received(*replicas, broken=(), late_s=0.0):
    """The router's receive, made when it is called: replica i starts its receive `i * late_s`
    after that and ends with it."""
    def result():
        now = time.time()
        return {"version": 1, "broken": list(broken),
                "replicas": [{"receive_verify_s": 0.2, "started_at": now + i * late_s, "ended_at": now}
                             for i in range(len(replicas))]}
    return result


class Router:
    def __init__(self, receives=(), dead=((),), plans=None):
        self.watch_weight_group = Call(None)
        self.plan_weight_group = Call(*(plans or [plan([0])]))
        self.receive_weights = Call(*(receives or [received(0)]))
        self.dead_weight_group_members = Call(*(list(d) for d in dead))
        self.join_weight_group = Call(2)


class LateRouter(Router):
    """A router whose receive answers once `recorded` is set: its members verified the weights
    (the trainer's answer says so), but its record of them is still on its way."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.recorded = asyncio.Event()
        self.receive_weights.call_one = self._receive

    async def _receive(self, version, mode):
        await self.recorded.wait()
        return received(0)()


def push(trainer, router, restart_dead=False):
    """One push's timings, with the replicas' side (`settled`) that follows."""
    sync = BroadcastSync(trainer, router, "bfloat16", "hot_swap", restart_dead)

    async def push_and_settle():
        timings = await sync.push(1)
        return {**timings, **await sync.settled()}
    return asyncio.run(push_and_settle())


@pytest.fixture
def fast_watch(monkeypatch):
    monkeypatch.setattr("rlactors.weight_sync.sync.BROADCAST_WATCH_S", 0.01)
    monkeypatch.setattr("rlactors.weight_sync.sync.BROADCAST_DEATH_GRACE_S", 0.05)


def test_a_push_that_a_member_received_completes():
    router = Router()
    timings = push(Trainer(), router)
    assert router.receive_weights.calls == [(1, "hot_swap")]  # the version every member must receive
    assert timings["bytes"] == 8.0 and timings["replica_receive_verify_s"] == 0.2 and timings["broadcast_tries"] == 1
    assert timings["send_s"] == 0.1 and timings["send_device_s"] == 0.08 and timings["pack_s"] == 0.05
    assert timings["total_s"] >= 0


def test_a_push_times_the_messaging_around_the_broadcast_by_the_slowest_side():
    timings = push(Trainer(lambda: sent(verified=2, receivers=2)),
                   Router(receives=[received(0, 1, late_s=5.0)], plans=[plan([0, 1])]))
    assert 0 <= timings["plan_s"] < timings["total_s"]
    assert 0 <= timings["send_lag_s"] < timings["total_s"] < 5.0
    assert 5.0 <= timings["receive_lag_s"] < 5.0 + timings["total_s"]  # the later replica's start
    assert 0 <= timings["reply_lag_s"] < timings["total_s"]


def test_a_push_that_every_member_verified_ends_on_the_trainers_answer_and_the_next_waits_for_the_routers():
    """The members' verdicts reach the trainer over the group: the router's answer, its record
    of who holds what, is not waited for until the next push plans."""
    router = LateRouter()

    async def two_pushes():
        sync = BroadcastSync(Trainer(), router, "bfloat16", "hot_swap", restart_dead=False)
        await sync.push(1)  # returns although the router has not answered
        second = asyncio.ensure_future(sync.push(2))
        await asyncio.sleep(0.05)
        waiting = not second.done() and len(router.plan_weight_group.calls) == 1
        router.recorded.set()
        await second
        return waiting, await sync.settled()

    waiting, settled = asyncio.run(two_pushes())
    assert waiting and len(router.plan_weight_group.calls) == 2
    assert settled["replica_receive_verify_s"] == 0.2


def test_a_push_that_formed_a_new_group_returns_once_the_router_recorded_it():
    """A restarted member serves once the router has recorded that it took the weights: the
    push that brought it into a group waits for that, so the next step's requests find it."""
    router = LateRouter(plans=[plan([0], stale=True, epoch=2)])

    async def run():
        sync = BroadcastSync(Trainer(), router, "bfloat16", "hot_swap", restart_dead=True)
        pushing = asyncio.ensure_future(sync.push(1))
        await asyncio.sleep(0.05)
        waiting = not pushing.done() and len(router.join_weight_group.calls) == 1
        router.recorded.set()
        await pushing
        return waiting

    assert asyncio.run(run())


def test_a_router_that_fails_to_record_a_verified_push_stops_the_next_one():
    router = Router(receives=[ActorError(RuntimeError("the record was lost"))])
    router.receive_weights.seconds = 0.2  # the trainer's answer comes first

    async def two_pushes():
        sync = BroadcastSync(Trainer(), router, "bfloat16", "hot_swap", restart_dead=True)
        await sync.push(1)  # every member verified
        await sync.push(2)

    with pytest.raises(WeightSyncError, match="the router failed to record the last push: the record was lost"):
        asyncio.run(two_pushes())
    assert len(router.receive_weights.calls) == 1  # the second push sent nothing


def test_a_push_that_a_member_did_not_verify_waits_for_the_router_to_name_it():
    rejected = ActorError(RuntimeError(f"weights version 1 rejected by replica 1: {ChecksumMismatch('c')!r}"))
    router = Router(receives=[rejected], plans=[plan([0, 1])])
    router.receive_weights.seconds = 0.2  # the trainer's answer comes first
    with pytest.raises(WeightSyncError, match="rejected by replica 1: ChecksumMismatch"):
        push(Trainer(lambda: sent(verified=1, receivers=2)), router)


def test_a_push_that_every_member_died_during_raises_no_replica_up():
    """gloo fails the trainer's broadcast at once: it is free, and no member is left."""
    with pytest.raises(NoReplicaUp, match=r"replica\(s\) \[0\] died during the broadcast, and no replica is up"):
        push(Trainer(BROKEN), Router(receives=[received()], dead=[[0]]))


def test_a_broadcast_that_outlives_a_dead_member_is_given_up_as_stuck(fast_watch):
    trainer = Trainer(broadcast_s=5.0)
    with pytest.raises(BroadcastStuck, match=r"replica\(s\) \[0\] died during the broadcast, which waits"):
        push(trainer, Router(receives=[received()], dead=[[0]]))
    assert trainer.abort_weight_broadcast.calls == []  # without restart_dead nothing is aborted


def test_a_broken_broadcast_without_restart_dead_stops_naming_the_dead_member():
    router = Router(receives=[received(0, broken=[0])], dead=[[1]], plans=[plan([0, 1])])
    with pytest.raises(MembersDied, match=r"replica\(s\) \[1\] died during the broadcast, which did not reach"):
        push(Trainer(BROKEN), router)
    assert router.join_weight_group.calls == []


def test_with_restart_dead_a_broken_broadcast_goes_again_to_a_new_group_of_the_members_up():
    trainer = Trainer(BROKEN, sent)
    router = Router(receives=[received(broken=[0]), received(0)], dead=[[1], []],
                    plans=[plan([0, 1]), plan([0], stale=True, restarting=[1])])
    timings = push(trainer, router, restart_dead=True)
    assert timings["broadcast_tries"] == 2 and timings["replica_receive_verify_s"] == 0.2
    # The survivor formed a new group with the trainer (world size 2), and took version 1 from it.
    assert trainer.init_weight_sender.calls == [("10.0.0.1", 29500, 2, "layout")]
    assert len(router.join_weight_group.calls) == 1 and len(router.receive_weights.calls) == 2


def test_with_restart_dead_a_push_whose_only_member_died_waits_for_its_restart(monkeypatch):
    monkeypatch.setattr("rlactors.weight_sync.sync.BROADCAST_WATCH_S", 0.01)
    trainer = Trainer(BROKEN, sent)
    router = Router(receives=[received(), received(0)], dead=[[0], []],
                    plans=[plan([0]), plan([], stale=True, restarting=[0]), plan([], stale=True, restarting=[0]),
                           plan([0], stale=True)])
    assert push(trainer, router, restart_dead=True)["broadcast_tries"] == 2
    assert len(router.plan_weight_group.calls) == 4 and trainer.init_weight_sender.calls[0][2] == 2


class AbortableBroadcast:
    """The trainer's broadcast as over NCCL with a dead member: the first one waits until it is
    aborted, then raises BroadcastBroken; the next one completes."""

    def __init__(self):
        self.aborted, self.calls = asyncio.Event(), 0

    async def call(self, version):
        self.calls += 1
        if self.calls == 1:
            await self.aborted.wait()
            raise BROKEN
        return sent()


def test_with_restart_dead_a_stuck_broadcast_is_aborted_and_goes_again(fast_watch):
    trainer = Trainer()
    trainer.send_weights = broadcast = AbortableBroadcast()

    async def abort():
        broadcast.aborted.set()

    async def dead_members():  # replica 0 is dead until its restart is up, after the abort
        return [] if broadcast.aborted.is_set() else [0]

    trainer.abort_weight_broadcast.call = abort
    router = Router(receives=[received(), received(0)], plans=[plan([0]), plan([0], stale=True)])
    router.dead_weight_group_members.call_one = dead_members
    assert push(trainer, router, restart_dead=True)["broadcast_tries"] == 2
    assert broadcast.calls == 2 and len(router.join_weight_group.calls) == 1


def test_with_restart_dead_a_trainer_still_stuck_after_the_abort_stops_the_run(fast_watch, monkeypatch):
    monkeypatch.setattr("rlactors.weight_sync.sync.ABORT_WAIT_S", 0.05)
    trainer = Trainer(broadcast_s=5.0)
    with pytest.raises(BroadcastStuck, match="which waits for every member"):
        push(trainer, Router(receives=[received()], dead=[[0]]), restart_dead=True)
    assert trainer.abort_weight_broadcast.calls == [()]


def test_with_restart_dead_a_failed_abort_stops_the_run_as_stuck(fast_watch):
    trainer = Trainer(broadcast_s=5.0)
    trainer.abort_weight_broadcast = Call(ActorError(RuntimeError("NCCL error: unhandled system error")))
    with pytest.raises(BroadcastStuck, match="which waits for every member"):
        push(trainer, Router(receives=[received()], dead=[[0]]), restart_dead=True)
    assert trainer.abort_weight_broadcast.calls == [()] and len(trainer.send_weights.calls) == 1


def test_with_restart_dead_members_dying_in_every_try_stop_the_push_after_its_tries():
    router = Router(receives=[received(broken=[0])], dead=[[1]], plans=[plan([0, 1]), plan([0], stale=True)])
    trainer = Trainer(BROKEN)
    with pytest.raises(MembersDied, match=r"replica\(s\) \[1\] died during the broadcast"):
        push(trainer, router, restart_dead=True)
    assert len(trainer.send_weights.calls) == BROADCAST_TRIES


def test_a_rejection_stops_the_push_even_with_restart_dead():
    rejected = ActorError(RuntimeError("weights version 1 rejected by replica 0: "
                                       f"{ChecksumMismatch('received checksum 1, trainer sent 2')!r}"))
    router = Router(receives=[rejected])
    with pytest.raises(WeightSyncError, match="failed: weights version 1 rejected by replica 0: ChecksumMismatch") as e:
        push(Trainer(unverified), router, restart_dead=True)
    assert not isinstance(e.value, MembersDied) and len(router.receive_weights.calls) == 1


def test_a_broken_broadcast_with_no_member_dead_stops_the_push_even_with_restart_dead():
    with pytest.raises(WeightSyncError, match="the broadcast group broke with no member dead") as e:
        push(Trainer(BROKEN), Router(receives=[received(0)]), restart_dead=True)
    assert not isinstance(e.value, MembersDied)


def test_a_push_to_a_group_that_no_replica_left_or_joined_since_its_plan_asks_the_router_nothing_first():
    """The router tells the push of every replica that comes up or goes down (its epoch); one
    that does makes the next push plan, and re-form the group if it is stale."""
    router = Router(plans=[plan([0], stale=True, epoch=1), plan([0, 1], stale=True, epoch=2)],
                    receives=[received(0), received(0, 1)])
    trainer = Trainer(sent, lambda: sent(verified=2, receivers=2))

    async def run():
        sync = BroadcastSync(trainer, router, "bfloat16", "hot_swap", restart_dead=True)
        await sync.start()  # plans and forms the group of replica 0
        port = router.watch_weight_group.calls[0][0]
        plans_before = len(router.plan_weight_group.calls)
        await sync.push(1)
        due = await sync.due(1)
        asked = len(router.plan_weight_group.calls) - plans_before
        port.send(2)  # replica 1 came up
        while sync._group_current():  # until the word arrives (a busy machine may take a while)
            await asyncio.sleep(0.01)
        second = await sync.push(2)
        return due, asked, second

    due, asked, second = asyncio.run(run())
    assert asked == 0 and not due
    # Told of a change, the push planned, found the group stale and formed it again, with replica 1.
    assert len(router.plan_weight_group.calls) == 2 and len(router.join_weight_group.calls) == 2
    assert trainer.init_weight_sender.calls[-1][2] == 3 and second["broadcast_tries"] == 1


def test_after_a_broken_broadcast_the_next_push_plans_again():
    router = Router(receives=[received(0, broken=[0]), received(0)], dead=[[1]],
                    plans=[plan([0, 1], stale=True, epoch=1), plan([0], stale=True, epoch=2)])
    trainer = Trainer(BROKEN, sent)

    async def run():
        sync = BroadcastSync(trainer, router, "bfloat16", "hot_swap", restart_dead=False)
        await sync.start()
        with pytest.raises(MembersDied):
            await sync.push(1)
        await sync.push(1)  # though the router has not yet told of replica 1's death

    asyncio.run(run())
    assert len(router.plan_weight_group.calls) == 2 and len(router.join_weight_group.calls) == 2


@pytest.mark.parametrize("stale", [False, True])
def test_a_push_is_due_for_a_new_version_or_for_a_replica_that_waits_for_weights(stale):
    router = Router(plans=[plan([0], stale=stale)])
    weights = BroadcastSync(Trainer(), router, "bfloat16", "hot_swap", restart_dead=True)
    assert asyncio.run(weights.due(1))  # version 0 was pushed last
    assert asyncio.run(weights.due(0)) == stale  # a restarted member, or a dead one, makes the group stale


def test_a_send_that_fails_on_the_trainers_side_stops_the_push_without_waiting_for_the_members(fast_watch):
    """The packing failed halfway (an out-of-memory, say): the members still wait for the rest of
    the broadcast, for ever over NCCL, so the push gives up on them at once."""
    trainer = Trainer(ActorError(RuntimeError("CUDA out of memory")))
    router = Router(receives=[received(0)])
    router.receive_weights.seconds = 30.0  # the members' receive that would never end
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match=r"the trainer's send failed: RuntimeError\('CUDA out of memory'\)"):
        push(trainer, router)
    assert time.monotonic() - start < 20  # not the 30 s of the receive


@pytest.mark.parametrize("overrides,pushes_with_step", [
    (['generator.weight_sync="messages"'], False),
    (['generator.weight_sync="broadcast"'], True),  # native replicas: they receive beside their steps
    (['generator.engine="vllm"', 'controller.device="cuda"'], True),  # auto: broadcast
    (['generator.engine="vllm"', 'controller.device="cuda"', "generator.tp=2"], False),
])
def test_a_push_goes_with_the_optimizer_step_only_by_broadcast_to_replicas_that_receive_beside_their_steps(
        overrides, pushes_with_step):
    """A vLLM replica whose TP workers run in other processes receives between its engine's steps:
    a receive started with the optimizer step would stall it for the whole step."""
    config = load_config(None, ['model.path="/nowhere"', *overrides], available_gpus=8)
    assert create_weight_sync(config, Trainer(), Router()).pushes_with_step == pushes_with_step

