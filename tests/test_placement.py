"""Where the meshes run (rlactors.placement). The process scheduler runs for real in
tests/test_e2e.py; Slurm cannot run here, so a stand-in SlurmJob checks what the config asks of it."""

import socket
import sys
from types import SimpleNamespace

import monarch.job
import pytest

from rlactors.config import JobConfig
from rlactors.placement import allocate_hosts, host_name


class RecordingSlurmJob:
    """Takes SlurmJob's arguments and hands out two named host meshes (or fails on `state`)."""

    made: list["RecordingSlurmJob"] = []
    fail_state = False

    def __init__(self, meshes, **kwargs):
        self.meshes, self.kwargs, self.kills = meshes, kwargs, 0
        RecordingSlurmJob.made.append(self)

    def state(self, cached_path):
        assert cached_path is None
        if RecordingSlurmJob.fail_state:
            raise TimeoutError("the allocation did not start")
        return SimpleNamespace(trainers="trainer host mesh", generators="generator host mesh")

    def kill(self):
        self.kills += 1


@pytest.fixture
def slurm(monkeypatch):
    RecordingSlurmJob.made, RecordingSlurmJob.fail_state = [], False
    monkeypatch.setattr(monarch.job, "SlurmJob", RecordingSlurmJob)
    return RecordingSlurmJob


def test_slurm_job_gets_the_configs_meshes_and_resources_and_is_released_once(slurm):
    hosts = allocate_hosts(JobConfig(scheduler="slurm", trainer_hosts=2, generator_hosts=1, gpus_per_host=8,
                                     partition="h200", time_limit="04:00:00"))
    (job,) = slurm.made
    assert job.meshes == {"trainers": 2, "generators": 1}
    assert job.kwargs == {"python_exe": sys.executable, "job_name": "rlactors", "gpus_per_node": 8,
                          "partition": "h200", "time_limit": "04:00:00"}
    assert (hosts.trainers, hosts.generators) == ("trainer host mesh", "generator host mesh")
    hosts.release()
    hosts.release()
    assert job.kills == 1
    allocate_hosts(JobConfig(scheduler="slurm"))  # no partition or time limit: the cluster's defaults
    assert slurm.made[1].kwargs["partition"] is None and slurm.made[1].kwargs["time_limit"] is None


def test_a_job_that_fails_to_start_is_killed(slurm):
    slurm.fail_state = True
    with pytest.raises(TimeoutError):
        allocate_hosts(JobConfig(scheduler="slurm"))
    assert slurm.made[0].kills == 1


def test_host_name_is_the_jobs_name_for_the_host(monkeypatch):
    monkeypatch.setenv("HYPERACTOR_PROCESS_NAME", "anon-0 @ generators_1")
    assert host_name() == "generators_1"
    monkeypatch.delenv("HYPERACTOR_PROCESS_NAME")
    assert host_name() == socket.gethostname()
