"""The order in which `Meshes.spawn` starts the trainer and the generators, what `stop` stops when
the trainer fails to start, and what `cause` blames for a proc's death under a Slurm job. Hosts,
procs and actors are stand-ins that record the calls."""

import asyncio
import concurrent.futures
from types import SimpleNamespace

import pytest
from support.stand_ins import SlurmJobEndingLate

from rlactors.config import load_config
from rlactors.procs.liveness import ProcLost
from rlactors.procs.placement import Hosts
from rlactors.run import meshes as meshes_module
from rlactors.run.meshes import Meshes


class StandInProcs:
    def __init__(self, name: str, events: list[str]):
        self.name, self.events = name, events

    async def stop(self) -> None:
        self.events.append(f"{self.name} procs stopped")


class StandInRouter:
    def __init__(self, events: list[str]):
        self.close = SimpleNamespace(call_one=self._close)
        self.events = events

    async def _close(self) -> None:
        self.events.append("router closed")


def stand_in_meshes(monkeypatch, ckpt, overrides: list[str], trainer_fails: bool = False) -> tuple[Meshes, list[str]]:
    events: list[str] = []

    async def allocate_hosts(job, gpus, log_dir):
        return SimpleNamespace(trainers="trainer hosts", generators="generator hosts", release=lambda: None)

    def spawn_router(config, hosts):
        events.append("router spawned")
        return StandInProcs("router", events), StandInRouter(events)

    async def spawn_trainer(self, config):
        events.append("trainer starting")
        await asyncio.sleep(0)  # the trainer's load: the router's replicas may start meanwhile
        if trainer_fails:
            raise RuntimeError("the trainer's checkpoint is unreadable")
        events.append("trainer ready")
        return StandInProcs("trainer", events), "trainer", [{"rank": 0, "host": "here"}]

    async def watch_procs(watcher, procs, labels):
        return []

    monkeypatch.setattr(meshes_module, "allocate_hosts", allocate_hosts)
    monkeypatch.setattr(meshes_module, "spawn_router", spawn_router)
    monkeypatch.setattr(Meshes, "_spawn_trainer", spawn_trainer)
    monkeypatch.setattr("rlactors.procs.liveness_actor.watch_procs", watch_procs)
    return Meshes(load_config(None, [f'model.path="{ckpt}"', *overrides], available_gpus=2)), events


@pytest.mark.parametrize("colocate, order", [
    (False, ["router spawned", "trainer starting", "trainer ready"]),  # GPUs of their own: at once
    (True, ["trainer starting", "trainer ready", "router spawned"]),  # an engine starts beside a loaded trainer
])
def test_the_generators_start_while_the_trainer_loads_unless_they_share_its_gpus(monkeypatch, tmp_path, tiny_ckpt,
                                                                                  colocate, order):
    overrides = ['controller.device="cuda"', 'generator.engine="vllm"', "trainer.ranks=1", "generator.replicas=1",
                 f"controller.colocate={str(colocate).lower()}"]
    meshes, events = stand_in_meshes(monkeypatch, tiny_ckpt, overrides)
    trainer, router, ranks = asyncio.run(meshes.spawn(tmp_path))
    assert events == order
    assert ranks == [{"rank": 0, "host": "here"}] and meshes.trainer_ready_s >= 0

    async def stop():
        await meshes.stop(router)

    events.clear()
    asyncio.run(stop())
    assert sorted(events) == ["router closed", "router procs stopped", "trainer procs stopped"]


def test_a_trainer_that_fails_to_start_leaves_no_generator_running(monkeypatch, tmp_path, tiny_ckpt):
    meshes, events = stand_in_meshes(monkeypatch, tiny_ckpt, [], trainer_fails=True)  # CPU: generators of their own

    async def spawn_then_stop():
        with pytest.raises(RuntimeError, match="unreadable"):
            await meshes.spawn(tmp_path)
        await meshes.stop(None)  # the controller got no router back

    asyncio.run(spawn_then_stop())
    assert events == ["router spawned", "trainer starting", "router closed", "router procs stopped"]


def test_a_proc_killed_by_a_scancel_is_blamed_on_the_slurm_job_and_no_host_is_left(monkeypatch, tiny_ckpt):
    monkeypatch.setattr("rlactors.procs.slurm.SlurmJob", SlurmJobEndingLate)
    meshes = Meshes(load_config(None, [f'model.path="{tiny_ckpt}"'], available_gpus=0))
    meshes.hosts = Hosts("trainers", "generators", SlurmJobEndingLate(answers=2))  # squeue tells late
    died = "trainer rank 0 (pid 7) exited (signal 15)"
    verdict = concurrent.futures.Future()
    verdict.set_result(died)
    meshes._trainer_watch = [SimpleNamespace(verdict=verdict)]  # the rank the watcher saw die
    assert meshes.trainer_lost() == died
    cause = asyncio.run(meshes.cause(ProcLost(died)))
    assert cause == meshes.hosts_lost == "the Slurm job 7 ended: CANCELLED"
    assert meshes.trainer_lost() is None  # no trainer restart on hosts that are gone
