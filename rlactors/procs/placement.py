"""Placement: where a run's procs live and which devices and addresses they use.

The meshes live on this host or on the hosts of a Monarch job (`job.scheduler`). The trainer
mesh spans `job.trainer_hosts` hosts (`trainer.ranks` split evenly, dims hosts x gpus);
the generator replicas spread over `job.generator_hosts` hosts of their own, or over the trainer
hosts when it is 0, replica r on host r // (replicas per host). The router and the controller
stay on this host.
"""

from __future__ import annotations

import asyncio
import math
import os
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlactors.config import JobConfig

TRAINER_MESH = "trainers"
GENERATOR_MESH = "generators"
# How long a proc's death under a Slurm job waits for squeue to say whether the job ended (a
# scancel, a time limit) before the proc alone is blamed.
SLURM_SETTLE_S = 10.0


def cuda_visible_devices(gpu_ids: Sequence[int]) -> str:
    """CUDA_VISIBLE_DEVICES for a child proc given GPUs `gpu_ids` of this process's view.

    Ids count the GPUs this process sees: when it was itself started with CUDA_VISIBLE_DEVICES
    (say "4,5,6,7"), id 0 is GPU 4, so a job confined to part of a node stays there.
    """
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if not visible:
        return ",".join(str(i) for i in gpu_ids)
    if max(gpu_ids) >= len(visible):
        raise ValueError(f"GPU ids {list(gpu_ids)} exceed the {len(visible)} GPUs of CUDA_VISIBLE_DEVICES={visible}")
    return ",".join(visible[i] for i in gpu_ids)


def expandable_segments(alloc_conf: str | None = None) -> bool:
    """Whether PyTorch's CUDA caching allocator grows expandable segments under the settings
    `alloc_conf`; by default this process's (PYTORCH_CUDA_ALLOC_CONF, else PYTORCH_ALLOC_CONF, the
    order in which PyTorch reads them)."""
    if alloc_conf is None:
        alloc_conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF", "")
    settings = dict(item.split(":", 1) for item in alloc_conf.replace(" ", "").split(",") if ":" in item)
    return settings.get("expandable_segments") == "True"


def set_expandable_segments(enabled: bool) -> None:
    """Has this process's CUDA caching allocator grow expandable segments (or plain ones) from its
    next allocation on."""
    import torch  # placement is read by processes that never touch a GPU

    torch._C._accelerator_setAllocatorSettings(f"expandable_segments:{enabled}")


def local_address() -> str:
    """This host's address as the other hosts of the job reach it."""
    return socket.gethostbyname(socket.gethostname())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@dataclass
class Hosts:
    trainers: Any  # HostMesh
    generators: Any  # HostMesh
    job: Any = None  # the Monarch job that owns them (None: this host)

    def lost(self) -> str | None:
        """What took the hosts away when their Slurm job has ended ('the Slurm job 7 ended:
        CANCELLED'); None while they hold, or for hosts of another kind."""
        from rlactors.procs.slurm import SlurmJob

        return self.job.ended() if isinstance(self.job, SlurmJob) else None

    async def lost_by_now(self, within_s: float = SLURM_SETTLE_S, every_s: float = 0.5) -> str | None:
        """`lost`, asked again for up to `within_s` seconds where the hosts are a Slurm job's: a
        proc of a cancelled job can die (SIGTERM) before squeue says that the job ended, or while
        slurmctld is too busy to answer; None when they still hold then, or are of another kind."""
        from rlactors.procs.slurm import SlurmJob

        if not isinstance(self.job, SlurmJob):
            return None
        deadline = time.monotonic() + within_s
        # squeue runs off the event loop
        while (reason := await asyncio.to_thread(self.lost)) is None and time.monotonic() < deadline:
            await asyncio.sleep(every_s)
        return reason

    async def wait_lost(self, every_s: float = 2.0) -> str:
        """What took the hosts away (`lost`), once it has happened, checked every `every_s`
        seconds; never returns for hosts that are not a Slurm job's."""
        reason = await self.lost_by_now(within_s=math.inf, every_s=every_s)
        if reason is None:  # not a Slurm job's: never lost
            await asyncio.get_running_loop().create_future()
        return reason

    def release(self) -> None:
        """Ends the job's worker processes (or its Slurm allocation); nothing for this host."""
        if self.job is not None:
            self.job.kill()
            self.job = None


class NoHosts(RuntimeError):
    """The job's hosts could not be had (a Slurm job refused, or ended before it started)."""


async def allocate_hosts(job: JobConfig, gpus: bool, log_dir: Path) -> Hosts:
    """The host meshes of `job`: this host for both, or a job's named host meshes (the trainer
    mesh for both when job.generator_hosts is 0). A Slurm job asks for job.gpus_per_host GPUs a
    node when `gpus`, and its workers write their output to `log_dir`."""
    from monarch.actor import this_host

    if job.scheduler == "local":
        return Hosts(this_host(), this_host())
    meshes = {TRAINER_MESH: job.trainer_hosts}
    if job.generator_hosts:
        meshes[GENERATOR_MESH] = job.generator_hosts
    if job.scheduler == "process":
        from monarch.job import ProcessJob

        monarch_job = ProcessJob(meshes)
    else:
        from rlactors.procs.slurm import SlurmJob

        monarch_job = SlurmJob(meshes, python_exe=sys.executable, job_name="rlactors", log_dir=str(log_dir),
                               gpus_per_node=job.gpus_per_host if gpus else None,
                               partition=job.partition or None, time_limit=job.time_limit or None,
                               monarch_port=job.worker_port)
    try:
        if job.scheduler == "slurm":
            await monarch_job.submit_and_wait()
        state = monarch_job.state(cached_path=None)
        trainers = getattr(state, TRAINER_MESH)
        return Hosts(trainers, getattr(state, GENERATOR_MESH) if job.generator_hosts else trainers, monarch_job)
    except BaseException as e:
        monarch_job.kill()
        if job.scheduler == "slurm" and isinstance(e, RuntimeError):  # Monarch's word for a refused or ended job
            raise NoHosts(f"the Slurm job did not start: {' '.join(str(e).split())}") from None
        raise


def num_hosts(hosts: Any) -> int:
    """Hosts in a host mesh (1 for this host, a mesh without a hosts dim)."""
    return hosts.extent["hosts"] if "hosts" in hosts.extent.keys() else 1


def host_of(hosts: Any, index: int) -> Any:
    """Host `index` of a host mesh; this host (a mesh without a hosts dim) for any index."""
    return hosts.slice(hosts=index) if "hosts" in hosts.extent.keys() else hosts


def first_value(values: Any) -> Any:
    """The value of the first point of a whole-mesh call (rank 0), whatever the mesh's dims."""
    return values.item(**{dim: 0 for dim in values.extent.keys()})


def host_name() -> str:
    """This proc's host: a job's worker as Monarch names it ('trainers_1'), else the hostname."""
    process = os.environ.get("HYPERACTOR_PROCESS_NAME", "")  # "<proc> @ <host>" in a job's procs
    return process.split(" @ ", 1)[1] if " @ " in process else socket.gethostname()


def placement_line(ranks: Sequence[dict[str, Any]], router_stats: dict[str, Any]) -> str:
    """The host and process id of each trainer rank and of each generator replica (its state while
    it has no engine), in order: where to look at a run (py-spy, top) or stop one part of it."""
    trainer = [f"{r['host']} (pid {r['pid']})" for r in ranks]
    replicas = [f"{r['engine']['host']} (pid {r['engine']['pid']})" if r["engine"] else r["state"]
                for r in router_stats["replicas"]]
    return f"trainer ranks on {', '.join(trainer)}; generator replicas on {', '.join(replicas)}"
