"""Weight sync: after each optimizer step, the trainer's policy reaches every generator replica,
verified by checksum. The protocol is driven from here; the router's side is in
`rlactors.weight_sync.replicas`, each replica's in `rlactors.weight_sync.updates`, the broadcast
itself in `rlactors.weight_sync.broadcast`. The actors' endpoints it calls are thin shells over them.

The controller holds one `WeightSync`, made by `create_weight_sync(config, trainer, router)` for
`generator.weight_sync` (a concrete value once the config is loaded: "auto" is resolved then),
calls `await sync.start()` once the meshes are up and `await sync.push()` whenever
`await sync.due(policy_version)`: the trainer's policy version differs from `sync.version`, or (by
broadcast) a restarted replica waits for weights. `push()` returns once every replica has verified the
weights; each replica loads them at its next engine step boundary (`generator.update_mode`: after
its in-flight requests finish, or at once as a hot swap) and admits no new request before then
(`rlactors.weight_sync.updates`).

`MessagesSync` (`messages`): full tensors in Monarch messages.

1. `trainer.state_dict_for_sync(dtype)` on every rank (a collective: each rank's shards gathered
   into rank 0's full tensors, on CPU); rank 0 returns `VersionedWeights` with their checksum.
2. `router.update_weights(version, tensors, checksum, mode)` sends them to every serving replica
   at once: `Generator.update_weights` -> `WeightUpdates.update_weights` checks the checksum,
   names and shapes beside the running engine, queues the load and returns. The router's
   `ReplicaWeights` keeps the last version sent, and brings a restarted replica to it before that
   replica serves.

`BroadcastSync` (`broadcast`): one packed buffer from trainer rank 0 to every replica at once,
over NCCL on GPUs or gloo on CPU (`rlactors.weight_sync.broadcast`). The group's members are
fixed when it is formed, so it is formed at `start()` and again before a push whenever a member
died or a restarted replica is up:

1. `router.plan_weight_group()`: the replicas that are up (serving, or restarted and awaiting
   weights), whether they differ from the current group (`stale`), and the world size (trainer
   rank 0 plus every TP worker of every member).
2. `trainer.weight_sync_address()` (a free port on rank 0's host) and `trainer.weight_layout(dtype)`
   (the packed buffer's layout); then, together, `trainer.init_weight_sender(...)` (rank 0's
   `WeightSender` joins as rank 0) and `router.join_weight_group(host, port, layout)` (the
   router's `ReplicaWeights` (rlactors.weight_sync.replicas) has each member's
   `Generator.join_weight_group` -> `WeightUpdates.join_weight_group`
   (rlactors.weight_sync.updates) join through its engine's `broadcast_receiver()`: a
   `BufferReceiver` per native engine or vLLM TP worker, whose receive buffer, and a version in
   it waiting for its load, survive the change of group).
3. A push: `trainer.pack_weights()` on every rank (all ranks gather into rank 0's send buffer,
   which is checksummed) beside the plan of step 1; then, together, `trainer.broadcast_weights()`
   and `router.receive_weights(version, checksum, mode)` (each member's
   `WeightUpdates.receive_weights` -> its receiver's `receive`: the broadcast lands in the
   receive buffer and its checksum is checked beside the running engine; the receiver's `load`
   follows at a step boundary). A restarted member serves from the first broadcast it receives.
4. While the broadcast runs, `router.dead_weight_group_members()` every 0.5 s: NCCL waits for a
   dead member for ever (gloo fails at once), so a broadcast that outlives a member's death by
   `BROADCAST_DEATH_GRACE_S` is given up (`BroadcastStuck`). NCCL may also let the sender finish
   a broadcast small enough to fit its buffers; if every member died meanwhile, the push raises
   `NoReplicaUp` (the trainer is not stuck, so its step can still be saved).

A replica that rejects the weights (checksum, names, shapes) keeps serving its previous version,
and the push raises `WeightSyncError` naming it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from monarch.actor import ActorError

from rlactors.config import Config
from rlactors.placement import first_value

# A weight broadcast still running this long after one of its members died is stuck: NCCL waits
# for every member for ever (gloo fails by itself at once).
BROADCAST_DEATH_GRACE_S = 2.0
# How often a running broadcast asks the router which members have died.
BROADCAST_WATCH_S = 0.5


class WeightSyncError(RuntimeError):
    """A push did not reach the replicas; the message says why."""


class NoReplicaUp(WeightSyncError):
    """No generator replica is up to receive the weights."""


class BroadcastStuck(WeightSyncError):
    """A member died during a broadcast, which waits for every member: the trainer is stuck in
    the collective, so nothing more can be saved."""


class WeightSync:
    """The trainer's policy to every replica. `version`: the policy version every replica has
    verified (0: the weights of `model.path`, which every replica starts from)."""

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

    async def push(self) -> dict[str, float]:
        """Sends the trainer's current policy; returns once every replica has verified it.

        Returns seconds spent gathering the weights (with packing and checksumming: `gather_s`)
        and moving them (transfer and verification: `transfer_s`), the bytes moved to each
        replica, and the variant's own timings."""
        raise NotImplementedError


class MessagesSync(WeightSync):
    async def push(self) -> dict[str, float]:
        start = time.perf_counter()
        weights = first_value(await self.trainer.state_dict_for_sync.call(self.dtype))
        gathered = time.perf_counter()
        try:
            await self.router.update_weights.call_one(weights.version, weights.weights, weights.checksum,
                                                      self.update_mode)
        except ActorError as e:  # a replica rejected the weights (checksum, names, shapes)
            raise WeightSyncError(f"weight sync of policy version {weights.version} failed: {e.exception}") from None
        self.version = weights.version
        num_bytes = float(sum(t.numel() * t.element_size() for t in weights.weights.values()))
        return {"gather_s": gathered - start, "transfer_s": time.perf_counter() - gathered, "bytes": num_bytes}


class BroadcastSync(WeightSync):
    async def start(self) -> None:
        await self._form_group(await self.router.plan_weight_group.call_one())

    async def _replicas_wait(self) -> bool:
        # A restarted replica serves from the first broadcast it receives, and no other way: a
        # step whose rollouts it could not serve (the only replica) trains nothing, so no new
        # version would ever be pushed to it. A member that died makes the group stale too: the
        # push re-forms it, or stops the run when no replica is up.
        return (await self.router.plan_weight_group.call_one())["stale"]

    async def _form_group(self, plan: dict[str, Any]) -> None:
        """Forms a new group with the replicas `plan` names (the router's `plan_weight_group`),
        on a new port, in place of the previous one."""
        if not plan["members"]:
            raise NoReplicaUp("no generator replica is up to receive the weights")
        host, port = first_value(await self.trainer.weight_sync_address.call())
        layout = first_value(await self.trainer.weight_layout.call(self.dtype))
        await asyncio.gather(self.trainer.init_weight_sender.call(host, port, plan["world_size"], self.dtype),
                             self.router.join_weight_group.call_one(host, port, layout))

    async def push(self) -> dict[str, float]:
        start = time.perf_counter()
        packed, plan = await asyncio.gather(self.trainer.pack_weights.call(),
                                            self.router.plan_weight_group.call_one())
        if plan["stale"]:  # a member died, or a restarted replica waits for weights
            await self._form_group(plan)
        packed = first_value(packed)
        version, gathered = packed["version"], time.perf_counter()
        try:
            sent, received = await self._broadcast(version, packed["checksum"])
        except ActorError as e:  # a replica rejected the weights (checksum), or a side failed
            raise WeightSyncError(f"weight sync of policy version {version} failed: {e.exception}") from None
        if not received["replicas"]:  # NCCL lets a sender finish a broadcast it could buffer whole
            raise NoReplicaUp(f"weight sync of policy version {version}: generator replica(s) {plan['members']} "
                              "died during the broadcast, and no replica is up to receive the weights")
        self.version = version
        sender = first_value(sent)
        # Where the time went: the trainer's gather and checksum, its broadcast (which waits for
        # every receiver to join), and the slowest replica's receive + checksum check. The
        # replicas load after this returns, between engine steps.
        return {"gather_s": gathered - start, "transfer_s": time.perf_counter() - gathered,
                "bytes": sender["bytes"], "pack_s": packed["pack_s"], "checksum_s": packed["checksum_s"],
                "broadcast_s": sender["broadcast_s"],
                "replica_receive_verify_s": max((r["receive_verify_s"] for r in received["replicas"]), default=0.0)}

    async def _broadcast(self, version: int, checksum: str) -> tuple[Any, dict[str, Any]]:
        """The trainer's broadcast together with every member's receive, watched for members
        that die meanwhile (step 4 of the protocol)."""
        transfer = asyncio.ensure_future(asyncio.gather(
            self.trainer.broadcast_weights.call(),
            self.router.receive_weights.call_one(version, checksum, self.update_mode)))
        dead_since = None
        while not (await asyncio.wait([transfer], timeout=BROADCAST_WATCH_S))[0]:
            dead = await self.router.dead_weight_group_members.call_one()
            if not dead:
                continue
            dead_since = dead_since or time.monotonic()
            if time.monotonic() - dead_since >= BROADCAST_DEATH_GRACE_S:
                transfer.cancel()
                transfer.add_done_callback(lambda f: f.cancelled() or f.exception())  # abandoned, not an error
                raise BroadcastStuck(f"weight sync of policy version {version}: generator replica(s) {dead} died "
                                     "during the broadcast, which waits for every member")
        return transfer.result()


def create_weight_sync(config: Config, trainer: Any, router: Any) -> WeightSync:
    """The variant `config.generator.weight_sync` names, between `trainer` and `router`."""
    variant = {"messages": MessagesSync, "broadcast": BroadcastSync}[config.generator.weight_sync]
    return variant(trainer, router, config.model.dtype, config.generator.update_mode)
