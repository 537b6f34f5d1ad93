"""Where the meshes run (rlactors.procs.placement). The process scheduler runs for real in
tests/test_e2e.py, Slurm in tests/test_slurm.py; here a stand-in SlurmJob checks what the config
asks of it, and the squeue output of two Slurm versions is read."""

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from support.stand_ins import SlurmJobEndingLate

import rlactors.procs.slurm
from rlactors.config import JobConfig
from rlactors.procs.placement import Hosts, NoHosts, allocate_hosts, host_name
from rlactors.procs.slurm import job_info

LOGS = Path("/runs/r/slurm")


class RecordingSlurmJob:
    """Takes SlurmJob's arguments and hands out two named host meshes (or fails on `state`)."""

    made: list["RecordingSlurmJob"] = []
    fail_submit = False

    def __init__(self, meshes, **kwargs):
        self.meshes, self.kwargs, self.kills = meshes, kwargs, 0
        RecordingSlurmJob.made.append(self)

    async def submit_and_wait(self):
        if RecordingSlurmJob.fail_submit:
            raise RuntimeError("Failed to submit SLURM job: sbatch: error: invalid partition specified: h100")

    def state(self, cached_path):
        assert cached_path is None
        return SimpleNamespace(**{name: f"{name} host mesh" for name in self.meshes})

    def kill(self):
        self.kills += 1


def _allocate(job: JobConfig, gpus: bool):
    return asyncio.run(allocate_hosts(job, gpus=gpus, log_dir=LOGS))


@pytest.fixture
def slurm(monkeypatch):
    RecordingSlurmJob.made, RecordingSlurmJob.fail_submit = [], False
    monkeypatch.setattr(rlactors.procs.slurm, "SlurmJob", RecordingSlurmJob)
    return RecordingSlurmJob


def test_slurm_job_gets_the_configs_meshes_and_resources_and_is_released_once(slurm):
    hosts = _allocate(JobConfig(scheduler="slurm", trainer_hosts=2, generator_hosts=1, gpus_per_host=8,
                                partition="h200", time_limit="04:00:00", worker_port=29500), gpus=True)
    (job,) = slurm.made
    assert job.meshes == {"trainers": 2, "generators": 1}
    assert job.kwargs == {"python_exe": sys.executable, "job_name": "rlactors", "log_dir": str(LOGS),
                          "gpus_per_node": 8, "partition": "h200", "time_limit": "04:00:00", "monarch_port": 29500}
    assert (hosts.trainers, hosts.generators) == ("trainers host mesh", "generators host mesh")
    hosts.release()
    hosts.release()
    assert job.kills == 1
    # No partition or time limit: the cluster's defaults; a CPU run asks for no GPUs.
    _allocate(JobConfig(scheduler="slurm"), gpus=False)
    assert [slurm.made[1].kwargs[k] for k in ("partition", "time_limit", "gpus_per_node")] == [None, None, None]
    assert slurm.made[1].kwargs["monarch_port"] == 22222  # Monarch's own default


def test_generators_on_the_trainer_hosts_are_one_mesh_of_the_trainer_hosts(slurm):
    hosts = _allocate(JobConfig(scheduler="slurm", trainer_hosts=2, generator_hosts=0), gpus=True)
    assert slurm.made[0].meshes == {"trainers": 2}
    assert hosts.trainers == hosts.generators == "trainers host mesh"


def test_a_slurm_job_that_fails_to_start_is_killed_and_says_why(slurm):
    slurm.fail_submit = True
    with pytest.raises(NoHosts, match=r"^the Slurm job did not start: Failed to submit SLURM job: sbatch: error: "
                                      r"invalid partition specified: h100$"):
        _allocate(JobConfig(scheduler="slurm"), gpus=True)
    assert slurm.made[0].kills == 1


# `squeue --json --job 3` of Slurm 22.05 (Debian 12), trimmed: every job, whatever --job says.
SQUEUE_22_05 = {"jobs": [
    {"job_id": 2, "job_state": "CANCELLED", "job_resources": {
        "nodes": "vm", "allocated_hosts": 1, "allocated_nodes": [{"nodename": "vm", "cpus_used": 0}]}},
    {"job_id": 3, "job_state": "RUNNING", "job_resources": {
        "nodes": "gpu[1-2]", "allocated_hosts": 2,
        "allocated_nodes": [{"nodename": "gpu1", "cpus_used": 2}, {"nodename": "gpu2", "cpus_used": 2}]}},
    {"job_id": 4, "job_state": "PENDING", "job_resources": {}}]}
# Slurm 23.11 on: the shape Monarch's SlurmJob reads.
SQUEUE_23_11 = {"jobs": [{"job_id": 3, "job_state": ["RUNNING"], "job_resources": {
    "nodes": {"count": 2, "list": "gpu[1-2]", "allocation": [{"index": 0, "name": "gpu1"},
                                                             {"index": 1, "name": "gpu2"}]}}}]}


def test_squeue_of_slurm_22_05_is_read_as_monarch_reads_newer_slurms():
    old, new = job_info(SQUEUE_22_05, "3"), job_info(SQUEUE_23_11, "3")
    for info in (old, new):
        assert info["job_id"] == 3 and info["job_state"] == ["RUNNING"]
        assert [node["name"] for node in info["job_resources"]["nodes"]["allocation"]] == ["gpu1", "gpu2"]
    assert new == SQUEUE_23_11["jobs"][0]
    assert job_info(SQUEUE_22_05, "4") == {"job_id": 4, "job_state": ["PENDING"], "job_resources": {}}
    assert job_info(SQUEUE_22_05, "5") is None  # not (or no longer) in the queue


def test_host_name_is_the_jobs_name_for_the_host(monkeypatch):
    monkeypatch.setenv("HYPERACTOR_PROCESS_NAME", "anon-0 @ generators_1")
    assert host_name() == "generators_1"
    monkeypatch.delenv("HYPERACTOR_PROCESS_NAME")
    assert host_name() == socket.gethostname()


@pytest.mark.parametrize(("job", "returncode", "stderr", "ended"), [
    ("2", 0, "", "the Slurm job 2 ended: CANCELLED"),
    ("3", 0, "", None),
    ("5", 0, "", "the Slurm job 5 ended (it has left the queue)"),
    ("5", 1, "slurm_load_jobs error: Invalid job id specified", "the Slurm job 5 ended (it has left the queue)"),
    ("3", 1, "slurm_load_jobs error: Socket timed out on send/recv operation", None),  # no news: it runs on
])
def test_what_ended_a_slurm_job_is_read_from_squeue(monkeypatch, job, returncode, stderr, ended):
    listed = subprocess.CompletedProcess([], returncode, json.dumps(SQUEUE_22_05) if returncode == 0 else "", stderr)
    monkeypatch.setattr(rlactors.procs.slurm, "_squeue", lambda job_id: listed)
    # No Monarch job: only its id is read.
    slurm_job = rlactors.procs.slurm.SlurmJob.__new__(rlactors.procs.slurm.SlurmJob)
    slurm_job._slurm_job_id = job
    assert slurm_job.ended() == ended


@pytest.fixture
def late_slurm(monkeypatch):
    monkeypatch.setattr(rlactors.procs.slurm, "SlurmJob", SlurmJobEndingLate)


def test_a_proc_death_under_a_cancelled_slurm_job_is_the_jobs_end_once_squeue_says_so(late_slurm):
    job = SlurmJobEndingLate(answers=3)  # the procs died (SIGTERM) before squeue told of the scancel
    hosts = Hosts("trainers", "generators", job)
    assert asyncio.run(hosts.lost_by_now(within_s=30, every_s=0.01)) == "the Slurm job 7 ended: CANCELLED"
    assert job.asked == 3


def test_a_proc_death_under_a_running_slurm_job_is_the_procs_after_the_settling_time(late_slurm):
    job = SlurmJobEndingLate(answers=None)
    hosts = Hosts("trainers", "generators", job)
    start = time.monotonic()
    assert asyncio.run(hosts.lost_by_now(within_s=0.2, every_s=0.01)) is None
    assert time.monotonic() - start >= 0.2 and job.asked > 1
    assert asyncio.run(Hosts("this host", "this host").lost_by_now(within_s=30)) is None  # not a job's: at once
