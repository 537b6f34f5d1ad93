"""GeneratorRouter: one actor in front of R Generator replicas.

- Replicas: each in its own proc mesh (one replica's death never takes another down), spread
  evenly over the hosts of `hosts` if given; replica r sees only `gpu_ids[r]` of its host.
- Routing: least loaded; a `session_id` sticks to the replica that served it first unless that
  one is dead or far busier (`ReplicaPicker`).
- States (`ReplicaState`): `starting`, `serving`, `awaiting_weights` (restarted under broadcast
  or a shared buffer, out of routing until a push reaches it), `dead` (for good; a restart is a new replica).
- Failover: a call that fails because a replica's proc or engine loop died is retried on a
  serving replica (a streamed one continues from the tokens sent); a ValueError goes back to the
  caller. Dead or slow: rlactors.procs.liveness.
- Weights: the weight endpoints call this router's `ReplicaWeights` (rlactors.weight_sync.replicas).
The protocols in full: docs/ARCHITECTURE.md (Generation, Failover, Weight sync).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from monarch.actor import (
    Actor,
    ActorError,
    Channel,
    Port,
    PortReceiver,
    concurrent_endpoint,
    default_bootstrap_cmd,
    this_host,
)

from rlactors.actors.generator import Generator
from rlactors.actors.token_stream import StreamedAttempts
from rlactors.config import UNRESPONSIVE_TIMEOUT_S, GeneratorConfig, ModelConfig
from rlactors.procs.liveness import ProcLost, ProcWatcher, WatchedProc
from rlactors.procs.liveness_actor import watch_procs
from rlactors.procs.placement import cuda_visible_devices, host_of, num_hosts
from rlactors.types import Completion, EngineDeadError, SamplingParams
from rlactors.weight_sync.replicas import ReplicaWeights

logger = logging.getLogger(__name__)


class ReplicaPicker:
    """Least-loaded choice with sticky sessions. Loads are in-flight counts; None marks a dead replica.

    A session stays on its replica while that replica is alive and its load is at most
    `sticky_factor * least + sticky_slack`; otherwise it moves to the least loaded one. Sessions
    are forgotten least-recently-used first beyond `max_sessions`.
    """

    def __init__(self, sticky_factor: float = 2.0, sticky_slack: int = 8, max_sessions: int = 100_000):
        self.sticky_factor = sticky_factor
        self.sticky_slack = sticky_slack
        self.max_sessions = max_sessions
        self.sessions: OrderedDict[str, int] = OrderedDict()
        self._turn = 0

    def pick(self, loads: Sequence[int | None], session_id: str | None = None,
             exclude: frozenset[int] = frozenset()) -> int | None:
        live = [i for i, load in enumerate(loads) if load is not None and i not in exclude]
        if not live:
            return None
        # Ties rotate, so equal loads spread requests evenly.
        self._turn += 1
        least = min(live, key=lambda i: (loads[i], (i - self._turn) % len(loads)))
        if session_id is None:
            return least
        sticky = self.sessions.get(session_id)
        if sticky in live and loads[sticky] <= self.sticky_factor * loads[least] + self.sticky_slack:
            self.sessions.move_to_end(session_id)
            return sticky
        self.sessions[session_id] = least
        self.sessions.move_to_end(session_id)
        while len(self.sessions) > self.max_sessions:
            self.sessions.popitem(last=False)
        return least


class ReplicaState(enum.Enum):
    STARTING = "starting"  # spawned; not yet answered its first call (or brought to the latest weights)
    SERVING = "serving"  # takes requests
    AWAITING_WEIGHTS = "awaiting_weights"  # restarted under broadcast sync: up, serves after its first broadcast
    DEAD = "dead"  # its proc or engine loop died, or it failed to start; never serves again

    @property
    def up(self) -> bool:
        """Serving or awaiting weights: a member of the next weight broadcast group."""
        return self in (ReplicaState.SERVING, ReplicaState.AWAITING_WEIGHTS)


@dataclass(eq=False)  # one object per spawn: compared by identity
class _Replica:
    index: int
    name: str
    procs: Any
    actor: Any
    restarted: bool = False  # spawned to replace a dead replica (a restart that fails is not retried)
    state: ReplicaState = ReplicaState.STARTING
    in_flight: int = 0
    routed: int = 0
    completed: int = 0
    version: int | None = None
    watched: WatchedProc | None = None  # once it is up

    @property
    def up(self) -> bool:
        return self.state.up


class GeneratorRouter(Actor):
    def __init__(self, generator_config: GeneratorConfig, model_config: ModelConfig,
                 gpu_ids: Sequence[Sequence[int]] | None = None, hosts: Any = None,
                 unresponsive_timeout_s: float = UNRESPONSIVE_TIMEOUT_S, kv_cache_bytes: int | None = None):
        g = generator_config
        self.hosts = hosts if hosts is not None else this_host()
        self.replicas_per_host = g.replicas // num_hosts(self.hosts)  # they split evenly (Config.validate)
        if gpu_ids is not None:
            if len(gpu_ids) != g.replicas or any(len(ids) != g.tp for ids in gpu_ids):
                raise ValueError(f"gpu_ids must list generator.tp={g.tp} GPU ids for each of the "
                                 f"generator.replicas={g.replicas} replicas, got {gpu_ids}")
        self.generator_config = generator_config
        self.model_config = model_config
        self.kv_cache_bytes = kv_cache_bytes
        self.gpu_ids = [list(ids) for ids in gpu_ids] if gpu_ids is not None else None
        self.picker = ReplicaPicker()
        self.watcher = ProcWatcher(unresponsive_timeout_s)
        self.weights = ReplicaWeights(g.tp, died=self._mark_dead, received=self._received_weights)
        self.counters = {"retries": 0, "deaths": 0, "restarts": 0, "failed_restarts": 0}
        self._spawned = 0
        self._serving = asyncio.Event()  # set while a replica serves, or when none can come
        self._restarts: dict[int, asyncio.Task] = {}
        self.replicas = [self._spawn(i) for i in range(g.replicas)]
        self._ready: asyncio.Task | None = None

    # -- replicas ---------------------------------------------------------------------------

    def _spawn(self, index: int, restarted: bool = False) -> _Replica:
        self._spawned += 1
        name = f"generator{index}x{self._spawned}"
        bootstrap = None
        if self.gpu_ids is not None:
            env = {"CUDA_VISIBLE_DEVICES": cuda_visible_devices(self.gpu_ids[index])}
            bootstrap = default_bootstrap_cmd().with_env(env)
        host = host_of(self.hosts, index // self.replicas_per_host)
        procs = host.spawn_procs(per_host={"gpus": 1}, bootstrap_command=bootstrap)
        actor = procs.spawn(name, Generator, self.generator_config, self.model_config, index, self.kv_cache_bytes)
        return _Replica(index, name, procs, actor, restarted)

    async def _ensure_started(self) -> None:
        """Waits (once) until every first replica answers; one that fails is handled as a death."""
        if self._ready is None:
            self._ready = asyncio.ensure_future(asyncio.gather(*(self._start(r) for r in self.replicas)))
        await asyncio.shield(self._ready)

    async def _start(self, replica: _Replica) -> None:
        if not await self._bring_up(replica):
            self._mark_dead(replica, RuntimeError("it failed to start"))

    def _serving_replicas(self) -> list[_Replica]:
        return [r for r in self.replicas if r.state is ReplicaState.SERVING]

    async def _bring_up(self, replica: _Replica) -> bool:
        """Waits for a new replica's first answer, watches its proc, and brings it to the latest
        weights sent by messages; True once it serves, or, with broadcast sync, once it is up and
        waits for the next weight group."""
        try:
            replica.version = (await replica.actor.stats.call_one())["version"]
            await self._watch(replica)
            by_broadcast = await self.weights.bring_up(replica)
        except Exception as e:  # noqa: BLE001 - any failure to start means it does not serve
            logger.error("generator replica %d (%s) failed to start: %s", replica.index, replica.name, e)
            return False
        if replica.state is not ReplicaState.STARTING:
            return False  # found dead meanwhile
        if by_broadcast:
            replica.state = ReplicaState.AWAITING_WEIGHTS
        else:
            self._serve(replica)
        self.weights.up_changed()
        return True

    async def _watch(self, replica: _Replica) -> None:
        """Watches the replica's proc: its calls fail over, and it is dead, once it is lost."""
        (replica.watched,) = await watch_procs(self.watcher, replica.procs,
                                               [f"generator replica {replica.index}"])
        replica.actor = self.watcher.guard(replica.actor, [replica.watched])
        replica.watched.verdict.add_done_callback(
            lambda verdict: verdict.cancelled() or self._mark_dead(replica, ProcLost(verdict.result())))

    def _slow(self, replica: _Replica) -> bool:
        return replica.watched is not None and self.watcher.slow(replica.watched)

    def _serve(self, replica: _Replica) -> None:
        replica.state = ReplicaState.SERVING
        self._serving.set()

    def _received_weights(self, replica: _Replica) -> None:
        if replica.state is ReplicaState.AWAITING_WEIGHTS:
            self._serve(replica)  # its first broadcast

    def _mark_dead(self, replica: _Replica, error: BaseException) -> None:
        if replica.state is ReplicaState.DEAD or replica is not self.replicas[replica.index]:
            return  # already handled, or a replica that has been replaced since
        served, was_up, replica.state = replica.state is ReplicaState.SERVING, replica.up, ReplicaState.DEAD
        if was_up:
            self.weights.up_changed()
        if served:
            self.counters["deaths"] += 1
        logger.warning("generator replica %d (%s) is dead: %s", replica.index, replica.name, error)
        if not self._serving_replicas():
            self._serving.clear()
        # A replica that served is restarted; one that never came up after a restart is not (no
        # crash loop); a restart in progress handles its own replica's failure.
        if (self.generator_config.restart_dead and replica.index not in self._restarts
                and (served or not replica.restarted)):
            self._restarts[replica.index] = asyncio.create_task(self._restart(replica))

    async def _restart(self, dead: _Replica) -> None:
        if dead.watched is not None:
            self.watcher.forget(dead.watched)  # stopped on purpose now
        try:
            try:
                await dead.procs.stop()
            except Exception:  # noqa: BLE001 - the proc is usually gone already
                pass
            replica = self.replicas[dead.index] = self._spawn(dead.index, restarted=True)
            if await self._bring_up(replica):
                self.counters["restarts"] += 1
            else:
                replica.state = ReplicaState.DEAD  # no restart loop: it stays dead, counted
                self.counters["failed_restarts"] += 1
        finally:
            self._restarts.pop(dead.index, None)
            if not self._serving_replicas() and not self._restarts:
                self._serving.set()  # nothing left to wait for: callers fail instead of hanging

    async def __supervise__(self, failure: Any) -> bool:
        # A replica's proc or actor failed: mark it dead now rather than at its next call.
        mesh_name = getattr(failure, "mesh_name", "")
        for replica in self.replicas:
            if mesh_name.startswith(replica.name + "-"):
                # Its exit, as the pidfd saw it (with the exit status), if that came first.
                lost = replica.watched and self.watcher.lost(replica.watched)
                self._mark_dead(replica, ProcLost(lost) if lost else RuntimeError(str(failure)))
        return True  # handled: the router lives on with the other replicas

    # -- endpoints --------------------------------------------------------------------------

    @concurrent_endpoint
    async def generate(self, prompt_token_ids: Sequence[int], sampling: SamplingParams | Mapping[str, Any],
                       request_id: str, session_id: str | None = None) -> Completion:
        """The replica's completion; retried on another replica when one fails (counted in stats)."""
        await self._ensure_started()
        return await self._route(request_id, session_id, lambda actor: actor.generate.call_one(
            prompt_token_ids, sampling, request_id, session_id))

    @concurrent_endpoint
    async def generate_streamed(self, prompt_token_ids: Sequence[int], sampling: SamplingParams | Mapping[str, Any],
                                request_id: str, tokens: Port, session_id: str | None = None) -> Completion:
        """`generate`, sending TokenDeltas to `tokens` as the replica samples them. When the replica
        fails mid-stream, another continues from the prompt + the tokens sent
        (rlactors.actors.token_stream): the completion is always those tokens + the rest."""
        await self._ensure_started()
        if not isinstance(sampling, SamplingParams):
            sampling = SamplingParams.from_dict(dict(sampling))
        attempts = StreamedAttempts(prompt_token_ids, sampling)

        async def relay(receiver: PortReceiver) -> None:
            while True:
                delta = attempts.forward(await receiver.recv())
                if delta is not None:
                    tokens.send(delta)

        async def attempt(actor: Any) -> Completion:
            request = attempts.next_request()
            if request is None:
                return attempts.ended(request_id)
            port, receiver = Channel.open()
            relaying = asyncio.create_task(relay(receiver))
            try:
                completion = await actor.generate_streamed.call_one(*request, request_id, port, session_id)
            finally:
                relaying.cancel()
            return attempts.completed(completion)

        return await self._route(request_id, session_id, attempt)

    async def _route(self, request_id: str, session_id: str | None,
                     call: Callable[[Any], Awaitable[Completion]]) -> Completion:
        """`call` on a replica's actor, picked for the session; on another when the replica fails."""
        failed: set[int] = set()
        last_error: BaseException | None = None
        # Bounded, so that a request that kills every engine it reaches cannot loop forever.
        for _ in range(2 * len(self.replicas) + 1):
            loads = [r.in_flight if r.state is ReplicaState.SERVING else None for r in self.replicas]
            # Slow replicas get no new request while another serving replica answers.
            slow = {i for i, r in enumerate(self.replicas) if self._slow(r)}
            index = self.picker.pick(loads, session_id, frozenset(failed | slow))
            if index is None:
                index = self.picker.pick(loads, session_id, frozenset(failed))
            if index is None:
                if self._restarts:
                    await self._serving.wait()  # a restart is under way
                    failed.clear()
                    if self._serving_replicas():
                        continue
                raise RuntimeError(f"request {request_id!r}: no live generator replica "
                                   f"(last error: {last_error!r})")
            replica = self.replicas[index]
            replica.in_flight += 1
            replica.routed += 1
            try:
                completion = await call(replica.actor)
            except ActorError as e:
                if not isinstance(e.exception, EngineDeadError):
                    raise e.exception from None  # the request is bad (ValueError), not the replica
                last_error = e
            except Exception as e:  # noqa: BLE001 - SupervisionError (dead proc), transport failures
                last_error = e
            else:
                replica.completed += 1
                return completion
            finally:
                replica.in_flight -= 1
            failed.add(index)
            self.counters["retries"] += 1
            self._mark_dead(replica, last_error)
        raise RuntimeError(f"request {request_id!r} failed on every replica it was sent to "
                           f"(last error: {last_error!r})")

    @concurrent_endpoint
    async def update_weights(self, version: int, named_tensors: Mapping[str, torch.Tensor],
                             checksum: str | None = None, mode: str | None = None) -> dict[str, Any]:
        """Loads `version` on every serving replica in parallel. A replica that rejects the weights
        (checksum mismatch, bad names or shapes) keeps its old version and the call raises naming
        it; a replica that dies meanwhile is restarted (if configured) with these weights."""
        await self._ensure_started()
        return await self.weights.update(version, named_tensors, checksum, mode, self._serving_replicas())

    @concurrent_endpoint
    async def watch_weight_group(self, port: Port) -> None:
        """`port` is sent a new epoch (a count) each time a replica comes up or goes down, from now on."""
        self.weights.watch(port)

    @concurrent_endpoint
    async def plan_weight_group(self) -> dict[str, Any]:
        """Who would form a new weight broadcast group now: every replica that is up (serving, or
        restarted and awaiting weights); `stale` when they differ from the current group's;
        `epoch`: the count of replicas that came up or went down so far (`watch_weight_group`);
        `restarting`: the slots whose restart is under way."""
        await self._ensure_started()
        return {**self.weights.plan([r for r in self.replicas if r.up]), "restarting": sorted(self._restarts)}

    @concurrent_endpoint
    async def join_weight_group(self, host: str, port: int, layout: Any) -> int:
        """The planned members join the trainer's new weight broadcast group; returns its world size."""
        return await self.weights.join(host, port, layout)

    @concurrent_endpoint
    async def dead_weight_group_members(self) -> list[int]:
        """Members of the current weight group that have died: a broadcast waits for them."""
        return self.weights.dead_members()

    @concurrent_endpoint
    async def dead_replicas(self) -> list[int]:
        """The replicas this router has found dead (its own record: no call to any replica); a
        slot whose replacement is spawned holds a new, starting replica."""
        return [r.index for r in self.replicas if r.state is ReplicaState.DEAD]

    @concurrent_endpoint
    async def receive_weights(self, version: int, mode: str | None = None) -> dict[str, Any]:
        """Every member of the weight group receives the trainer's broadcast of `version` (called
        together with the trainer's broadcast); a restarted member serves from then on. A replica
        whose checksum does not match, or that received another version, keeps its old weights
        and the call raises naming it; a replica that fails otherwise is marked dead."""
        return await self.weights.receive(version, mode)

    @concurrent_endpoint
    async def load_shared_weights(self, handle: Any, version: int, checksum: str,
                                  mode: str | None = None) -> dict[str, Any]:
        """Every replica that is up checks the trainer's shared buffer against `checksum` and
        loads it; returns once each has loaded it. A replica that rejects it keeps its old
        version and the call raises naming it; one that fails otherwise is marked dead; a
        restarted one serves from then on."""
        await self._ensure_started()
        return await self.weights.share(handle, version, checksum, mode, [r for r in self.replicas if r.up])

    @concurrent_endpoint
    async def awaiting_weights(self) -> dict[str, list[int]]:
        """The replicas up that serve only once weights reach them (restarted ones), and the
        slots whose restart is under way."""
        await self._ensure_started()
        return {"awaiting": [r.index for r in self.replicas if r.state is ReplicaState.AWAITING_WEIGHTS],
                "restarting": sorted(self._restarts)}

    @concurrent_endpoint
    async def sleep(self) -> None:
        """Every serving replica's engine sleeps (`generator.sleep`: the trainer's turn on their GPUs)."""
        await self._ensure_started()
        await asyncio.gather(*(r.actor.sleep.call_one() for r in self._serving_replicas()))

    @concurrent_endpoint
    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Every serving replica's engine takes back what its sleep freed (`tags`: "weights",
        "kv_cache"; None: both)."""
        await self._ensure_started()
        await asyncio.gather(*(r.actor.wake_up.call_one(tags) for r in self._serving_replicas()))

    @concurrent_endpoint
    async def stats(self) -> dict[str, Any]:
        """Router counters; per replica its state, load, version and, when serving, the replica's
        own stats; `states`: how many replicas are in each state.

        States are those the answer was made from: a replica counts as serving when it was
        serving as the call began and answered it (its stats are there); one that failed to
        answer is dead. Counters: `deaths` (serving replicas that died), `restarts` (replacements
        that came up), `failed_restarts`, `retries` (requests sent again after a replica
        failed), `weight_groups` (broadcast groups formed)."""
        await self._ensure_started()
        replicas = list(self.replicas)
        states = [r.state for r in replicas]
        serving = [r for r, state in zip(replicas, states) if state is ReplicaState.SERVING]
        engine_stats = await asyncio.gather(*(r.actor.stats.call_one() for r in serving), return_exceptions=True)
        by_replica = {}
        for replica, result in zip(serving, engine_stats):
            if isinstance(result, BaseException):
                self._mark_dead(replica, result)
                states[replicas.index(replica)] = ReplicaState.DEAD
            else:
                by_replica[replica] = result
        per_replica = [{"index": r.index, "state": state.value, "slow": self._slow(r), "in_flight": r.in_flight,
                        "routed": r.routed, "completed": r.completed, "version": r.version,
                        "engine": by_replica.get(r)}
                       for r, state in zip(replicas, states)]
        return {"replicas": per_replica, "states": {s.value: states.count(s) for s in ReplicaState},
                "restarting": sorted(self._restarts), "sessions": len(self.picker.sessions), **self.counters,
                "weight_groups": self.weights.groups_formed}

    @concurrent_endpoint
    async def close(self) -> None:
        """Closes every live replica's engine and stops all replica procs."""
        self.watcher.close()  # their exits are expected from here on
        for task in list(self._restarts.values()):
            task.cancel()
        serving = self._serving_replicas()
        await asyncio.gather(*(r.actor.close.call_one() for r in serving), return_exceptions=True)
        for replica in self.replicas:
            replica.state = ReplicaState.DEAD
        await asyncio.gather(*(r.procs.stop() for r in self.replicas), return_exceptions=True)

