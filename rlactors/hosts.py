"""Where a run's meshes live: this host, or the hosts of a Monarch job (`job.scheduler`).

The trainer mesh spans `job.trainer_hosts` hosts (`trainer.ranks` split evenly, dims hosts x gpus);
the generator replicas spread over `job.generator_hosts` hosts, replica r on host
r // (replicas per host). The router and the controller stay on this host.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from typing import Any

from rlactors.config import JobConfig

TRAINER_MESH = "trainers"
GENERATOR_MESH = "generators"


@dataclass
class Hosts:
    trainers: Any  # HostMesh
    generators: Any  # HostMesh
    job: Any = None  # the Monarch job that owns them (None: this host)

    def release(self) -> None:
        """Ends the job's worker processes (or its Slurm allocation); nothing for this host."""
        if self.job is not None:
            self.job.kill()
            self.job = None


def allocate_hosts(job: JobConfig) -> Hosts:
    """The host meshes of `job`: this host for both, or a job's two named host meshes."""
    from monarch.actor import this_host

    if job.scheduler == "local":
        return Hosts(this_host(), this_host())
    meshes = {TRAINER_MESH: job.trainer_hosts, GENERATOR_MESH: job.generator_hosts}
    if job.scheduler == "process":
        from monarch.job import ProcessJob

        monarch_job = ProcessJob(meshes)
    else:
        from monarch.job import SlurmJob

        monarch_job = SlurmJob(meshes, python_exe=sys.executable, job_name="rlactors",
                               gpus_per_node=job.gpus_per_host, partition=job.partition or None,
                               time_limit=job.time_limit or None)
    try:
        state = monarch_job.state(cached_path=None)
        return Hosts(getattr(state, TRAINER_MESH), getattr(state, GENERATOR_MESH), monarch_job)
    except BaseException:
        monarch_job.kill()
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
