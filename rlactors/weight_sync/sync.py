"""Weight sync's driver: after each optimizer step, the trainer's policy reaches every generator
replica, verified by checksum. The router's side is in `rlactors.weight_sync.replicas`, each
replica's in `rlactors.weight_sync.updates`, the broadcast itself in `rlactors.weight_sync.broadcast`.

The controller holds one `WeightSync`, made by `create_weight_sync(config, trainer, router)` for
`generator.weight_sync`, calls `await sync.start()` once the meshes are up and
`await sync.push(policy_version)` whenever `await sync.due(policy_version)`; where
`sync.pushes_with_step`, the push of the version an optimizer step makes starts with that step.
`push` returns once every replica has verified the weights; each loads them at its next engine
step boundary. `MessagesSync` sends full tensors in Monarch messages; `BroadcastSync` one packed
buffer from trainer rank 0 to every replica at once, re-forming its group when members die;
`SharedSync` packs into a buffer the replicas on the trainer's host map, and returns once they
loaded it. The calls of a push, step by step, and what each failure raises:
docs/ARCHITECTURE.md, "Weight sync".
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, NoReturn

from monarch.actor import ActorError, Channel, PortReceiver

from rlactors.config import Config
from rlactors.procs.placement import first_value
from rlactors.weight_sync.broadcast import BroadcastBroken
from rlactors.weight_sync.updates import stages_concurrently

# A weight broadcast still running this long after one of its members died is stuck: NCCL waits
# for every member for ever (gloo fails by itself at once).
BROADCAST_DEATH_GRACE_S = 2.0
# How often a running broadcast asks the router which members have died.
BROADCAST_WATCH_S = 0.5
# How long an aborted broadcast may take to return before the trainer counts as stuck.
ABORT_WAIT_S = 10.0
# With generator.restart_dead: how many broadcasts a push tries while members die during them,
# and how long it waits for a restarted replica when none is up (a vLLM replica takes minutes).
BROADCAST_TRIES = 3
RESTART_WAIT_S = 300.0


class WeightSyncError(RuntimeError):
    """A push did not reach the replicas; the message says why."""


class NoReplicaUp(WeightSyncError):
    """No generator replica is up to receive the weights."""


class MembersDied(WeightSyncError):
    """Members of the group died during a broadcast that did not reach every member still up;
    with `generator.restart_dead` the push broadcasts again, to a new group."""


class EveryMemberDied(NoReplicaUp, MembersDied):
    """Every member died during a broadcast that left the trainer free (gloo fails it at once)."""


class BroadcastStuck(WeightSyncError):
    """A member died during a broadcast, which waits for every member: the trainer is stuck in
    the collective, so nothing more can be saved."""


class WeightSync:
    """The trainer's policy to every replica. `version`: the policy version every replica has
    verified (0: the weights of `model.path`, which every replica starts from).
    `pushes_with_step`: whether a push of the version the trainer's next optimizer step makes may
    start with that step, the trainer sending as it ends."""

    pushes_with_step = False

    def __init__(self, trainer: Any, router: Any, dtype: str, update_mode: str):
        self.trainer = trainer
        self.router = router
        self.dtype = dtype
        self.update_mode = update_mode
        self.version = 0

    async def start(self) -> None:
        """Prepares the first push; called once the trainer and the router are up."""

    async def due(self, policy_version: int) -> bool:
        """Whether the trainer's policy must be pushed: a new version, or a replica up that cannot
        serve until a push reaches it."""
        return policy_version != self.version or await self._replicas_wait()

    async def _replicas_wait(self) -> bool:
        return False  # by messages the router brings a restarted replica to the last version itself

    async def settled(self) -> dict[str, float]:
        """Waits until the router has recorded the last push (which replica holds which version);
        returns the replicas' own timings of it, where the push did not."""
        return {}

    async def push(self, version: int) -> dict[str, float]:
        """Sends the trainer's policy `version` (its current one or, where `pushes_with_step`,
        the one its optimizer step under way makes); returns once every replica has verified it.

        Returns the seconds until then (`total_s`), the bytes moved to each replica, and the
        variant's own timings."""
        raise NotImplementedError


class MessagesSync(WeightSync):
    async def push(self, version: int) -> dict[str, float]:
        start = time.perf_counter()
        weights = first_value(await self.trainer.state_dict_for_sync.call(self.dtype))
        if weights.version != version:
            raise WeightSyncError(f"weight sync of policy version {version} failed: the trainer holds version "
                                  f"{weights.version}")
        gathered = time.perf_counter()
        try:
            await self.router.update_weights.call_one(version, weights.weights, weights.checksum, self.update_mode)
        except ActorError as e:  # a replica rejected the weights (checksum, names, shapes)
            raise WeightSyncError(f"weight sync of policy version {version} failed: {e.exception}") from None
        self.version = version
        num_bytes = float(sum(t.numel() * t.element_size() for t in weights.weights.values()))
        return {"total_s": time.perf_counter() - start, "gather_s": gathered - start,
                "transfer_s": time.perf_counter() - gathered, "bytes": num_bytes}


class SharedSync(WeightSync):
    """Through trainer rank 0's buffer, which each replica maps (rlactors.weight_sync.shared):
    a push packs and checksums it, then has every replica up check and load it, and returns
    once all have loaded it, so the next push repacks a buffer no replica reads any more. With
    `restart_dead`, a push that every replica died during waits for a restart and goes again."""

    def __init__(self, trainer: Any, router: Any, dtype: str, update_mode: str, restart_dead: bool):
        super().__init__(trainer, router, dtype, update_mode)
        self.restart_dead = restart_dead

    async def _replicas_wait(self) -> bool:
        return bool((await self.router.awaiting_weights.call_one())["awaiting"])  # a restart serves from a push

    async def push(self, version: int) -> dict[str, float]:
        start = time.perf_counter()
        packed = first_value(await self.trainer.share_weights.call(self.dtype))
        if packed["version"] != version:
            raise WeightSyncError(f"weight sync of policy version {version} failed: the trainer holds version "
                                  f"{packed['version']}")
        shared = time.perf_counter()
        replicas = await self._load(packed, version)
        if not replicas and self.restart_dead and await self._restarted():
            replicas = await self._load(packed, version)  # the buffer holds `version` still: nobody loaded it
        if not replicas:
            raise NoReplicaUp(f"weight sync of policy version {version}: no generator replica is up to load it")
        self.version = version
        return {"total_s": time.perf_counter() - start, "bytes": packed["bytes"], "pack_s": packed["pack_s"],
                "checksum_s": packed["checksum_s"], "load_s": time.perf_counter() - shared,
                "replica_verify_s": max(r["verify_s"] for r in replicas),
                "replica_load_s": max(r["apply_s"] for r in replicas)}

    async def _load(self, packed: dict[str, Any], version: int) -> list[dict[str, Any]]:
        """Every replica up checks and loads the buffer; the timings of those that loaded it."""
        try:
            loaded = await self.router.load_shared_weights.call_one(packed["handle"], version, packed["checksum"],
                                                                     self.update_mode)
        except ActorError as e:  # a replica rejected the weights (checksum, names, shapes)
            raise WeightSyncError(f"weight sync of policy version {version} failed: {e.exception}") from None
        return loaded["replicas"]

    async def _restarted(self) -> bool:
        """Whether a restarted replica is up, waited for while a restart is under way (at most
        RESTART_WAIT_S)."""
        waited = time.monotonic()
        while True:
            replicas = await self.router.awaiting_weights.call_one()
            if replicas["awaiting"] or not replicas["restarting"] or time.monotonic() - waited >= RESTART_WAIT_S:
                return bool(replicas["awaiting"])
            await asyncio.sleep(BROADCAST_WATCH_S)


class BroadcastSync(WeightSync):
    def __init__(self, trainer: Any, router: Any, dtype: str, update_mode: str, restart_dead: bool,
                 pushes_with_step: bool = False):
        super().__init__(trainer, router, dtype, update_mode)
        self.restart_dead = restart_dead
        # Only where the replicas receive beside their engine's steps: a receive started with the
        # optimizer step waits through it, and would stall an engine that receives between steps.
        self.pushes_with_step = pushes_with_step
        # The router's answer to the last push's broadcast, and the wall clock when it was asked.
        self._receipt: tuple[asyncio.Future, float] | None = None
        # The epochs (rlactors.weight_sync.replicas): the last the router told of, and the one
        # the current group was planned in (None: no group, or one that broke).
        self._listening: asyncio.Future | None = None
        self._heard_epoch = 0
        self._group_epoch: int | None = None

    async def start(self) -> None:
        port, changes = Channel.open()
        await self.router.watch_weight_group.call_one(port)
        self._listening = asyncio.ensure_future(self._listen(changes))
        await self._form_group(await self._plan())

    async def _listen(self, changes: PortReceiver) -> None:
        while True:
            self._heard_epoch = max(self._heard_epoch, await changes.recv())

    def _group_current(self) -> bool:
        """Whether no replica came up or went down since the current group was planned, as far
        as the router has told. Without its word (before `start`, or once the port failed) every
        push plans."""
        listening = self._listening is not None and not self._listening.done()
        return listening and self._group_epoch is not None and self._heard_epoch <= self._group_epoch

    async def _replicas_wait(self) -> bool:
        # A restarted replica serves from the first broadcast it receives, and no other way: a
        # step whose rollouts it could not serve (the only replica) trains nothing, so no new
        # version would ever be pushed to it. A member that died makes the group stale too: the
        # push re-forms it, or stops the run when no replica is up.
        if self._group_current():
            return False
        return self._planned(await self.router.plan_weight_group.call_one())["stale"]

    async def _plan(self) -> dict[str, Any]:
        """The router's plan of the next group; when no replica is up but one is restarting,
        the plan once it is up (waited for at most RESTART_WAIT_S)."""
        plan = await self.router.plan_weight_group.call_one()
        waited = time.monotonic()
        while not plan["members"] and plan["restarting"] and time.monotonic() - waited < RESTART_WAIT_S:
            await asyncio.sleep(BROADCAST_WATCH_S)
            plan = await self.router.plan_weight_group.call_one()
        return self._planned(plan)

    def _planned(self, plan: dict[str, Any]) -> dict[str, Any]:
        if not plan["stale"]:
            self._group_epoch = plan["epoch"]  # the group is the one it would form
        return plan

    async def _form_group(self, plan: dict[str, Any]) -> None:
        """Forms a new group with the replicas `plan` names (the router's `plan_weight_group`),
        on a new port, in place of the previous one."""
        if not plan["members"]:
            raise NoReplicaUp("no generator replica is up to receive the weights")
        host, port = first_value(await self.trainer.weight_sync_address.call())
        layout = first_value(await self.trainer.weight_layout.call(self.dtype))
        await asyncio.gather(self.trainer.init_weight_sender.call(host, port, plan["world_size"], layout),
                             self.router.join_weight_group.call_one(host, port, layout))
        self._group_epoch = plan["epoch"]

    async def push(self, version: int) -> dict[str, float]:
        start = time.perf_counter()
        await self.settled()  # the router has recorded the last push before this one
        plan = None if self._group_current() else await self._plan()
        plan_s = time.perf_counter() - start
        formed = False
        for tries in range(1, BROADCAST_TRIES + 1):
            if plan is not None and plan["stale"]:  # a member died, or a restarted replica waits for weights
                await self._form_group(plan)
                formed = True
            try:
                began = time.time()  # wall clock: compared with the sides' own, in other processes
                sent = await self._broadcast(version, began)
                ended = time.time()
                break
            except BaseException as e:
                self._group_epoch = None  # broken: the next broadcast goes to a new group
                if not isinstance(e, MembersDied) or not self.restart_dead or tries == BROADCAST_TRIES:
                    raise
                plan = await self._plan()  # the same version again, to a new group
        if formed:
            # A restarted member serves once the router has recorded that it took the weights:
            # requests sent before then would find no replica serving where it was the only one.
            await self.settled()
        self.version = version
        sender = first_value(sent)
        # Where the time went: the router's plan, if one was asked for; the trainer's send (packing,
        # and the broadcast beside it, which waits for every receiver and their verdicts; its span
        # on the device, the rest being the trainer's host's), and how long it waited for the
        # optimizer step it was sent with; and the messaging around it: how late the send call
        # reached the trainer after the push made it, and how long its answer took. The replicas'
        # side is `settled`'s. They load after this returns.
        return {"total_s": time.perf_counter() - start, "bytes": sender["bytes"], "send_s": sender["send_s"],
                "send_device_s": sender["send_device_s"], "pack_s": sender["pack_s"], "plan_s": plan_s,
                "step_wait_s": sender["step_wait_s"],
                "send_lag_s": sender["started_at"] - sender["step_wait_s"] - began,
                "reply_lag_s": ended - sender["ended_at"], "broadcast_tries": float(tries),
                "copy_engine": sender["copy_engine"]}

    async def settled(self) -> dict[str, float]:
        """The router's answer to the last push: the slowest member's receive + checksum, and how
        late the last receive started after the push asked for it ({} before the first push)."""
        if self._receipt is None:
            return {}
        receiving, began = self._receipt
        try:
            replicas = (await receiving)["replicas"]
        except ActorError as e:
            raise WeightSyncError(f"weight sync: the router failed to record the last push: {e.exception}") from None
        if not replicas:  # every member died since it verified the weights
            return {}
        return {"replica_receive_verify_s": max(r["receive_verify_s"] for r in replicas),
                "receive_lag_s": max(r["started_at"] for r in replicas) - began}

    async def _broadcast(self, version: int, began: float) -> Any:
        """The trainer's send together with every member's receive, watched for members that
        die meanwhile (step 4 of the protocol); returns the trainer's answer once every member
        verified the weights. MembersDied when a member died and the broadcast did not reach
        every member still up."""
        self._receipt = None
        sending = asyncio.ensure_future(self.trainer.send_weights.call(version))
        receiving = asyncio.ensure_future(self.router.receive_weights.call_one(version, self.update_mode))
        transfer = asyncio.ensure_future(asyncio.gather(sending, receiving, return_exceptions=True))
        dead_since = None
        while True:
            watched = [transfer] if sending.done() else [sending, transfer]
            done, _ = await asyncio.wait(watched, timeout=BROADCAST_WATCH_S, return_when=asyncio.FIRST_COMPLETED)
            if transfer in done:
                break
            if sending in done:
                failure = sending.exception()
                if failure is None and _every_member_verified(sending.result()):
                    self._receipt = (receiving, began)
                    return sending.result()
                if failure and not (isinstance(failure, ActorError) and isinstance(failure.exception, BroadcastBroken)):
                    # The trainer failed on its own side, or is lost: the members may wait for the
                    # rest of the broadcast for ever (NCCL does).
                    _let_go(transfer)
                    if not isinstance(failure, ActorError):
                        raise failure
                    raise WeightSyncError(f"weight sync of policy version {version} failed: the trainer's send "
                                          f"failed: {failure.exception!r}")
                continue  # the router's answer names who did not verify the weights
            dead = await self.router.dead_weight_group_members.call_one()
            if not dead:
                continue
            dead_since = dead_since or time.monotonic()
            if time.monotonic() - dead_since >= BROADCAST_DEATH_GRACE_S:
                await self._abandon(transfer, version, dead)
        sent, received = transfer.result()
        for outcome in (received, sent):  # the router's first: it names a replica that rejected the weights
            if isinstance(outcome, ActorError) and not isinstance(outcome.exception, BroadcastBroken):
                raise WeightSyncError(f"weight sync of policy version {version} failed: {outcome.exception}")
            if isinstance(outcome, BaseException) and not isinstance(outcome, ActorError):
                raise outcome  # the trainer or the router is lost
        if not isinstance(sent, BaseException) and received["replicas"] and not received["broken"]:
            self._receipt = (receiving, began)
            return sent  # a member that died meanwhile, if any, missed this version only
        # The group broke, or nobody took the weights: every member the router did not find dead
        # by now (the receive fails over once its proc is lost) lives.
        dead = await self.router.dead_weight_group_members.call_one()
        if not dead:
            error = sent.exception if isinstance(sent, BaseException) else f"replica(s) {received['broken']}"
            raise WeightSyncError(f"weight sync of policy version {version} failed: the broadcast group broke "
                                  f"with no member dead ({error})")
        if not received["replicas"] and not received["broken"]:  # the trainer is free: no member is left
            raise EveryMemberDied(f"weight sync of policy version {version}: generator replica(s) {dead} died "
                                  "during the broadcast, and no replica is up to receive the weights")
        raise MembersDied(f"weight sync of policy version {version}: generator replica(s) {dead} died during "
                          "the broadcast, which did not reach the members still up")

    async def _abandon(self, transfer: asyncio.Future, version: int, dead: list[int]) -> NoReturn:
        """Gives up a broadcast stuck on dead members (NCCL waits for them). With `restart_dead`
        the trainer's side is aborted, and once it and the members' receives have returned the
        push may form a new group (MembersDied); still unfinished after ABORT_WAIT_S (a trainer
        the abort did not free, a surviving member stuck in its own receive), BroadcastStuck."""
        if self.restart_dead and await self._abort_trainer_broadcast():
            if (await asyncio.wait([transfer], timeout=ABORT_WAIT_S))[0]:
                raise MembersDied(f"weight sync of policy version {version}: generator replica(s) {dead} died "
                                  "during the broadcast, which was aborted")
        _let_go(transfer)
        raise BroadcastStuck(f"weight sync of policy version {version}: generator replica(s) {dead} died "
                             "during the broadcast, which waits for every member")

    async def _abort_trainer_broadcast(self) -> bool:
        """Whether the trainer aborted its broadcast; one whose abort failed may still be inside
        the collective, so no new group is formed beside it."""
        try:
            await self.trainer.abort_weight_broadcast.call()
        except ActorError:
            return False
        return True


def _every_member_verified(sent: Any) -> bool:
    sender = first_value(sent)
    return sender["verified"] == sender["receivers"]


def _let_go(transfer: asyncio.Future) -> None:
    """Stops waiting for an abandoned broadcast; its outcome is not needed (nor reported)."""
    transfer.add_done_callback(lambda f: f.cancelled() or f.exception())
    transfer.cancel()


def create_weight_sync(config: Config, trainer: Any, router: Any) -> WeightSync:
    """The variant `config.generator.weight_sync` names, between `trainer` and `router`."""
    if config.generator.weight_sync == "broadcast":
        return BroadcastSync(trainer, router, config.model.dtype, config.generator.update_mode,
                             config.generator.restart_dead, stages_concurrently(config.generator.tp))
    if config.generator.weight_sync == "shared":
        return SharedSync(trainer, router, config.model.dtype, config.generator.update_mode,
                          config.generator.restart_dead)
    return MessagesSync(trainer, router, config.model.dtype, config.generator.update_mode)
