"""The router's side of weight sync: which replicas the weights go to, and what each one holds.

The router (rlactors.actors.router) holds one `ReplicaWeights`, which its weight endpoints call;
the replicas' states stay the router's, told through `died` and `received`.
- By messages, `update` sends a version's tensors to every serving replica and keeps them
  (`latest`), so that `bring_up` brings a restarted replica to that version before it serves.
- By broadcast, `plan(up)` names the replicas up now and whether the group's members are `stale`,
  as of an `epoch` that `up_changed` counts on and tells `watch`; `join` has every TP worker of
  every planned member join a new group; `receive` has the members still up receive a broadcast;
  `dead_members` names those that died.
- Through the trainer's shared buffer, `share` has every replica up check and load it.
A replica a push reaches takes the version, rejects the weights (the push raises naming it), finds
its group broken (`BroadcastBroken`), or fails otherwise: it died. In full: docs/ARCHITECTURE.md,
"Weight sync".
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from monarch.actor import ActorError

from rlactors.types import EngineDeadError
from rlactors.weight_sync.broadcast import BroadcastBroken


class Replica(Protocol):
    index: int
    actor: Any  # its Generator actor (rlactors.actors.generator)
    version: int | None  # the weights version it holds

    @property
    def up(self) -> bool:
        """Serving, or restarted and awaiting weights: a member of the next broadcast group."""


@dataclass(frozen=True)
class SentWeights:
    version: int
    tensors: Mapping[str, torch.Tensor]
    checksum: str | None


class ReplicaWeights:
    def __init__(self, tp: int, died: Callable[[Any, BaseException], None], received: Callable[[Any], None]):
        self.tp = tp
        self.died = died
        self.received = received
        self.latest: SentWeights | None = None  # by messages: the last weights a replica took
        self.group: list[Replica] | None = None  # by broadcast: the members of the current group, once formed
        self.planned: list[Replica] = []
        self.groups_formed = 0
        self.epoch = 0  # how many times a replica came up or went down
        self.watcher: Any = None  # a port told each new epoch
        self.shared = False  # whether weights have gone through the trainer's shared buffer

    # -- by messages ------------------------------------------------------------------------

    async def update(self, version: int, tensors: Mapping[str, torch.Tensor], checksum: str | None,
                     mode: str | None, serving: Sequence[Replica]) -> dict[str, Any]:
        """Sends `version` to every replica of `serving` at once; returns the replicas that took it."""
        start = time.perf_counter()
        # Kept first, so that a replica (re)starting meanwhile also comes up at this version.
        previous, self.latest = self.latest, SentWeights(version, tensors, checksum)
        rejected, _, _ = await self._fan_out(
            version, lambda r: r.actor.update_weights.call_one(version, tensors, checksum, mode), serving)
        if not any(r.version == version for r in serving):
            self.latest = previous  # nobody took these weights: restarts keep the old ones
        _raise_if_rejected(version, rejected)
        return {"version": version, "replicas": [r.index for r in serving if r.version == version],
                "seconds": time.perf_counter() - start}

    async def bring_up(self, replica: Replica) -> bool:
        """Brings a new replica to the latest weights sent by messages (a newer version that
        arrives meanwhile too). True when weights go by broadcast or the shared buffer instead: the
        replica waits for the next push, and serves from the first one it takes."""
        if self.group is not None or self.shared:
            return True
        while self.latest is not None and replica.version != self.latest.version:
            latest = self.latest
            await replica.actor.update_weights.call_one(latest.version, latest.tensors, latest.checksum)
            replica.version = latest.version
        return False

    # -- through the trainer's shared buffer -------------------------------------------------

    async def share(self, handle: Any, version: int, checksum: str, mode: str | None,
                    up: Sequence[Replica]) -> dict[str, Any]:
        """Every replica of `up` checks the shared buffer against `checksum` and loads it, at
        once; returns once each has loaded it (or rejected it, or died), with their timings."""
        start = time.perf_counter()
        self.shared = True
        rejected, _, timings = await self._fan_out(
            version, lambda r: r.actor.load_shared_weights.call_one(handle, version, checksum, mode), up)
        _raise_if_rejected(version, rejected)
        return {"version": version, "seconds": time.perf_counter() - start, "replicas": timings}

    # -- by broadcast -----------------------------------------------------------------------

    def watch(self, port: Any) -> None:
        """`port` is sent the new epoch each time a replica comes up or goes down."""
        self.watcher = port

    def up_changed(self) -> None:
        """A replica came up or went down: a plan made before may be stale."""
        self.epoch += 1
        if self.watcher is not None:
            self.watcher.send(self.epoch)

    def plan(self, up: list[Replica]) -> dict[str, Any]:
        """The group `up` would form, and whether the current one is stale, as of this epoch; its
        world size counts the trainer's rank 0. The plan is what the next `join` joins."""
        stale = self.group != up  # replicas compare by identity: a restarted one is a new member
        self.planned = up
        return {"stale": stale, "members": [r.index for r in up], "world_size": 1 + len(up) * self.tp,
                "epoch": self.epoch}

    async def join(self, host: str, port: int, layout: Any) -> int:
        """Every TP worker of the planned members joins the trainer's new group (each keeps its
        receive buffer). Called together with the trainer's side. Returns the world size."""
        members, tp = self.planned, self.tp
        world_size = 1 + len(members) * tp
        await asyncio.gather(*(r.actor.join_weight_group.call_one(host, port, 1 + m * tp, world_size, layout)
                               for m, r in enumerate(members)))
        self.group = members
        self.groups_formed += 1
        return world_size

    def dead_members(self) -> list[int]:
        """The members of the current group that died (a member is up until it dies)."""
        return [r.index for r in self.group or () if not r.up]

    async def receive(self, version: int, mode: str | None) -> dict[str, Any]:
        """Every member still up receives the trainer's broadcast of `version` (called together
        with it); returns each one's receive timings."""
        start = time.perf_counter()
        members = [r for r in self.group or () if r.up]
        rejected, broken, timings = await self._fan_out(
            version, lambda r: r.actor.receive_weights.call_one(version, mode), members)
        _raise_if_rejected(version, rejected)
        return {"version": version, "seconds": time.perf_counter() - start, "replicas": timings, "broken": broken}

    async def _fan_out(self, version: int, call: Callable[[Any], Awaitable[Any]],
                       replicas: Sequence[Replica]) -> tuple[list[str], list[int], list[Any]]:
        """`call(replica)` on each of `replicas` at once; returns the rejections, the replicas
        whose broadcast group broke (alive, without `version`), and the results of the replicas
        that took `version`."""
        results = await asyncio.gather(*(call(r) for r in replicas), return_exceptions=True)
        rejected, broken, accepted = [], [], []
        for replica, result in zip(replicas, results):
            if isinstance(result, ActorError) and isinstance(result.exception, BroadcastBroken):
                broken.append(replica.index)
            elif isinstance(result, ActorError) and not isinstance(result.exception, EngineDeadError):
                rejected.append(f"replica {replica.index}: {result.exception!r}")
            elif isinstance(result, BaseException):
                self.died(replica, result)
            else:
                replica.version = version
                self.received(replica)
                accepted.append(result)
        return rejected, broken, accepted


def _raise_if_rejected(version: int, rejected: list[str]) -> None:
    if rejected:
        raise RuntimeError(f"weights version {version} rejected by " + "; ".join(rejected))
