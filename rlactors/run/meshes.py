"""The procs of one run: the job's hosts, the trainer mesh on them (and with `teacher.path` the
teacher mesh, rlactors.actors.teacher) and the generator router on a proc of this host (its
replicas on the job's generator hosts). Each proc is watched
(rlactors.procs.liveness), so a call to one that exits or stays unresponsive fails at once with
ProcLost; a shutdown that a hung proc does not return from kills the procs after SHUTDOWN_WAIT_S.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from rlactors.config import Config
from rlactors.procs.liveness import ProcLost, ProcWatcher, this_machine, with_descendants
from rlactors.procs.placement import Hosts, NoHosts, allocate_hosts, host_name, num_hosts
from rlactors.run.generation import spawn_router
from rlactors.run.run_dir import TrainingError

logger = logging.getLogger(__name__)

# How long shutdown waits for the gateway, router and procs to stop before it kills the procs.
SHUTDOWN_WAIT_S = 60.0
T = TypeVar("T")


class HostsLost(Exception):
    """The job's hosts went away mid-run (its Slurm job cancelled or out of time); says how."""


class Meshes:
    """`spawn` starts the procs of `config`; `shutdown` stops them."""

    def __init__(self, config: Config):
        self.config = config
        self.watcher = ProcWatcher(config.controller.unresponsive_timeout_s)  # tells dead procs from slow ones
        self.hosts: Hosts | None = None
        self.hosts_lost: str | None = None  # what took the job's hosts away mid-run
        self._procs: list[Any] = []  # the router's last: on this host
        self._replica_pids: set[int] = set()  # replicas' OS processes on this machine (router_stats)
        self._trainer_watch: list[Any] = []  # the trainer ranks' WatchedProcs
        self.teacher: Any = None  # the Teacher mesh, guarded, with teacher.path
        self._kernels: Any = None  # what the trainer runs (rlactors.on_policy.sides)
        self._router: Any = None  # the GeneratorRouter, once spawned (unguarded)
        self.trainer_ready_s: float | None = None  # seconds from `spawn` until every trainer rank answered

    async def spawn(self, slurm_log_dir: Path) -> tuple[Any, Any, list[dict[str, Any]]]:
        """The trainer and the router, each guarded by the watcher, and the trainer's ranks."""
        import monarch.actor

        from rlactors.on_policy.sides import sides
        from rlactors.procs.liveness_actor import watch_procs

        # Monarch's default for a fault nobody handled is to kill this process; log it instead, so
        # the loop can stop cleanly (the failing call raises too).
        monarch.actor.unhandled_fault_hook = lambda failure: logger.error("unhandled Monarch fault: %s", failure)
        c = self.config
        start = time.monotonic()
        try:
            self.hosts = await allocate_hosts(c.job, gpus=c.controller.device == "cuda", log_dir=slurm_log_dir)
        except NoHosts as e:
            raise TrainingError(f"job.scheduler: {e}") from None
        self._kernels = sides(c.model.true_on_policy, c.generator.engine, c.controller.device).trainer
        # On GPUs of their own the replicas start (load, compile) while the trainer loads; colocated,
        # an engine starts beside a trainer that already holds its memory.
        router_procs = None if c.controller.colocate else self._spawn_router()
        trainer_procs, trainer, ranks = await self._spawn_trainer(c)
        self.trainer_ready_s = time.monotonic() - start
        teacher_procs = await self._spawn_teacher(c) if c.teacher.path else None
        if router_procs is None:
            router_procs = self._spawn_router()
        self._procs = [trainer_procs, *([teacher_procs] if teacher_procs else []), router_procs]
        # Calls to a proc that exits (or stays unresponsive past the timeout) fail at once with ProcLost.
        trainer = await self._watch_trainer(trainer_procs, trainer, ranks)
        router_watch = await watch_procs(self.watcher, router_procs, ["generator router"])
        return trainer, self.watcher.guard(self._router, router_watch), ranks

    def _spawn_router(self) -> Any:
        """Spawns the router (kept unguarded); its procs, which `stop` closes and stops from here
        on, also when the trainer fails to start."""
        router_procs, self._router = spawn_router(self.config, self.hosts.generators)
        self._procs = [router_procs]
        return router_procs

    async def _spawn_teacher(self, c: Config) -> Any:
        """The teacher's procs; sets `teacher`, whose calls fail with ProcLost once one exits."""
        from rlactors.actors.teacher import spawn_teacher
        from rlactors.procs.liveness_actor import watch_procs

        procs, teacher = await spawn_teacher(self.hosts.trainers, c.teacher, c.model, c.trainer, self._kernels,
                                             c.controller.device)
        ranks = num_hosts(self.hosts.trainers)  # one proc a host
        watched = await watch_procs(self.watcher, procs, [f"teacher rank {r}" for r in range(ranks)])
        self.teacher = self.watcher.guard(teacher, watched)
        return procs

    async def _watch_trainer(self, procs: Any, trainer: Any, ranks: list[dict[str, Any]]) -> Any:
        from rlactors.procs.liveness_actor import watch_procs

        self._trainer_watch = await watch_procs(self.watcher, procs, [f"trainer rank {r['rank']}" for r in ranks])
        return self.watcher.guard(trainer, self._trainer_watch)

    def trainer_lost(self) -> str | None:
        """The verdict of a trainer rank that was lost (rlactors.procs.liveness), else None; None
        too once the job's hosts are lost, where no trainer can be rebuilt."""
        return None if self.hosts_lost else self.watcher.lost(*self._trainer_watch)

    async def respawn_trainer(self) -> tuple[Any, list[dict[str, Any]]]:
        """Replaces the trainer mesh, one of whose ranks was lost, with a new one on the same hosts
        (rlactors.run.recovery): the ranks left on this machine are killed (they may wait in a
        collective for the lost one), the old procs stopped, killed if they do not stop within
        SHUTDOWN_WAIT_S; returns the new trainer, guarded, and its ranks."""

        c = self.config
        local = [p.pid for p in self._trainer_watch  # the lost rank's pid may be another process's by now
                 if p.pid is not None and p.machine == this_machine() and not p.verdict.done()]
        for proc in self._trainer_watch:
            self.watcher.forget(proc)  # stopped on purpose from here on
        for pid in with_descendants(local):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        try:
            await asyncio.wait_for(self._procs[0].stop(), SHUTDOWN_WAIT_S)
        except Exception as e:  # noqa: BLE001 - its procs are dead or killed: the new mesh does not need them
            logger.warning("stopping the lost trainer's procs: %s", " ".join(str(e).split()) or type(e).__name__)
        procs, trainer, ranks = await self._spawn_trainer(c)
        self._procs[0] = procs
        return await self._watch_trainer(procs, trainer, ranks), ranks

    async def _spawn_trainer(self, c: Config) -> tuple[Any, Any, int]:
        from rlactors.actors.trainer import spawn_trainer

        return await spawn_trainer(self.hosts.trainers, c.model, c.trainer, self._kernels, c.controller.device,
                                   reference=c.loss.kl_coef > 0, teacher=c.teacher)

    async def router_stats(self, router: Any) -> dict[str, Any]:
        """The stats of `router`; notes the OS processes of the replicas that run on this
        machine, which a stuck shutdown kills."""
        stats = await router.stats.call_one()
        # The replicas up now only: a dead replica's pid may since belong to another process.
        self._replica_pids = {r["engine"]["pid"] for r in stats["replicas"]
                              if r["engine"] is not None and r["engine"]["host"] == host_name()}
        return stats

    async def while_hosts_hold(self, work: Awaitable[T]) -> T:
        """Runs `work`, but cancels it as soon as the job's hosts are gone (Monarch would notice
        only when its calls to them time out) and raises HostsLost."""
        task = asyncio.ensure_future(work)
        lost = asyncio.ensure_future(self.hosts.wait_lost())
        try:
            await asyncio.wait({task, lost}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # Ctrl-C: the work ends as it would alone
            task.cancel()
            return await task
        finally:
            lost.cancel()
        if task.done():
            return task.result()
        self.hosts_lost = lost.result()
        task.cancel()
        await asyncio.wait({task})
        raise HostsLost(self.hosts_lost)

    async def finish(self, work: Awaitable[T], interrupted: str) -> T:
        """Runs `work` to its end even when cancelled (saying `interrupted` on stderr), unless the
        job's hosts are lost: then its trainer and generators are gone and it cannot end."""
        task = asyncio.ensure_future(work)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():
                if self.hosts_lost:
                    task.cancel()
                    raise
                print(interrupted, file=sys.stderr, flush=True)
                await task
            raise

    async def cause(self, error: BaseException) -> str:
        """What `error` (a SupervisionError or ProcLost) lost: the job's hosts (then also
        `hosts_lost`), else the watcher's verdict ("trainer rank 0 (pid 7) exited (signal 9)"),
        which Monarch's own SupervisionError may precede by a moment; else Monarch's words."""
        if lost := await self.hosts.lost_by_now():
            self.hosts_lost = lost
            return lost
        if isinstance(error, ProcLost):
            return str(error)
        watched = self.watcher.procs
        if watched:
            await asyncio.wait([p.verdict for p in watched], timeout=2.0, return_when=asyncio.FIRST_COMPLETED)
        return self.watcher.lost(*watched) or " ".join(str(error).split())

    async def stop(self, router: Any) -> None:
        """Closes `router` (None: the router spawned, if any, which `spawn` did not return) and stops
        the procs, the trainer's and the router's at once; once the job's hosts are lost, only the
        procs on this host (the router's): nothing on the lost hosts answers, and a call there
        would wait for Monarch's timeouts."""
        router = router if router is not None else self._router
        if router is not None and not self.hosts_lost:
            try:
                await router.close.call_one()
            except Exception as e:  # noqa: BLE001 - shutting down: report and go on
                logger.warning("router close failed: %s", e)

        async def stop_procs(procs: Any) -> None:
            try:
                await procs.stop()
            except Exception as e:  # noqa: BLE001
                logger.warning("stopping procs failed: %s", e)

        await asyncio.gather(*(stop_procs(procs) for procs in (self._procs[-1:] if self.hosts_lost else self._procs)))

    async def shutdown(self, stop: Callable[[], Awaitable[None]]) -> None:
        """Runs `stop` (what stops the gateway, the router and the procs). A proc still inside a
        call that does not return (a collective whose peer died, say) is killed after
        SHUTDOWN_WAIT_S, with the replicas' procs last seen in `router_stats` and every process
        under them all (vLLM's engine processes), so that the run's last line is never held back
        by its own shutdown."""
        local = [(p.label, p.pid) for p in self.watcher.procs if p.pid is not None and p.machine == this_machine()]
        self.watcher.close()  # the procs' exits are expected from here on
        try:
            await asyncio.wait_for(stop(), SHUTDOWN_WAIT_S)
        except TimeoutError:
            for pid in with_descendants([pid for _, pid in local] + sorted(self._replica_pids)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            killed = [label for label, _ in local] + [f"replica pid {pid}" for pid in sorted(self._replica_pids)]
            print(f"warning: the procs did not stop within {SHUTDOWN_WAIT_S:.0f} s; killed "
                  f"{', '.join(killed) or 'none (none of them runs on this machine)'}", file=sys.stderr, flush=True)
        finally:
            self.release_hosts()

    def release_hosts(self) -> None:
        """Ends the job's worker processes or its Slurm allocation (idempotent); also called by a
        second Ctrl-C, which quits without a shutdown."""
        if self.hosts is not None:
            self.hosts.release()
