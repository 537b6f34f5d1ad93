"""Monarch's SlurmJob as rlactors runs it: one sbatch allocation whose nodes carry the meshes.

Two differences from Monarch 0.7's own:
- It reads `squeue --json` of Slurm 22.05 (Debian 12's) too. That Slurm lists every job whatever
  `--job` asks, names a job's state as a string and its nodes under
  `job_resources.allocated_nodes`; Monarch reads the first job listed, a list of states, and
  `job_resources.nodes.allocation` (Slurm 23.11 on).
- The controller listens on this host's address as `placement.local_address` resolves it, not on
  Monarch's choice (the hostname's first non-loopback address, which a machine whose hostname
  resolves to 127.0.0.1, as a one-machine cluster's may, lacks: Monarch then panics).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from typing import Any

from monarch.actor import enable_transport
from monarch.job import SlurmJob as MonarchSlurmJob

from rlactors.procs.placement import local_address

# Job states after which the allocation is gone (squeue --json's names).
_ENDED = {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
          "TIMEOUT"}


def job_info(squeue: dict[str, Any], job_id: str) -> dict[str, Any] | None:
    """Job `job_id` of `squeue --json`'s output, shaped as Monarch's SlurmJob reads it (a list of
    states; the nodes as `job_resources.nodes.allocation[].name`); None when it is not listed."""
    for job in squeue.get("jobs", []):
        if str(job.get("job_id")) != job_id:
            continue
        state = job.get("job_state", [])
        resources = job.get("job_resources") or {}
        if "allocated_nodes" in resources:  # Slurm before 23.11
            resources = {"nodes": {"allocation": [{"name": node["nodename"]}
                                                  for node in resources["allocated_nodes"]]}}
        return {**job, "job_state": [state] if isinstance(state, str) else state, "job_resources": resources}
    return None


class SlurmJob(MonarchSlurmJob):
    def __init__(self, meshes: dict[str, int], **kwargs: Any) -> None:
        super().__init__(meshes, **kwargs)
        enable_transport(f"tcp://{local_address()}:0")

    async def submit_and_wait(self, every_s: float = 2.0) -> None:
        """Submits the job (sbatch) and returns once it runs; a cancel (Ctrl-C) ends the wait in
        the queue at once (Monarch's own wait, in `state`, would hold the event loop)."""
        self.apply()
        while True:
            info = await asyncio.to_thread(self._get_job_info_json, self._slurm_job_id)
            states = info["job_state"] if info else ["gone from the queue"]
            if "RUNNING" in states:
                return
            if info is None or set(states) & _ENDED:
                raise RuntimeError(f"the Slurm job {self._slurm_job_id} ended in the queue ({', '.join(states)})")
            await asyncio.sleep(every_s)

    def ended(self) -> str | None:
        """What ended the allocation ('the Slurm job 7 ended: CANCELLED'); None while it runs, or
        while squeue cannot tell (slurmctld busy or restarting)."""
        job_id = self._slurm_job_id
        left = f"the Slurm job {job_id} ended (it has left the queue)"
        listed = _squeue(job_id)
        if listed.returncode != 0:
            return left if "Invalid job id" in listed.stderr else None
        try:
            info = job_info(json.loads(listed.stdout), job_id)
        except ValueError:
            return None
        if info is None:
            return left
        states = sorted(set(info["job_state"]) & _ENDED)
        return f"the Slurm job {job_id} ended: {', '.join(states)}" if states else None

    def _get_job_info_json(self, job_id: str) -> dict[str, Any] | None:
        listed = _squeue(job_id)
        return job_info(json.loads(listed.stdout), job_id) if listed.returncode == 0 else None


def _squeue(job_id: str) -> subprocess.CompletedProcess:
    return subprocess.run(["squeue", "--json", "--job", job_id], capture_output=True, text=True)
