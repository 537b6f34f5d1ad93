"""job.scheduler = 'slurm' against a real Slurm: a one-machine cluster (scripts/slurm_cluster.sh,
started here and stopped afterwards), one allocation whose node carries the trainer ranks and the
generator replicas (job.generator_hosts = 0). The run is the CLI in a subprocess: it trains like
the one-host run; a scancel stops it naming its last checkpoint, and --resume continues it in a
new allocation; its allocation is released, with nothing of it left running, when it ends,
fails or is interrupted. Skipped, with the reason, where Slurm cannot be installed (no root, no
apt-get)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.demo_runs import WARM_CHECKPOINT, short_run_overrides
from support.slurm_clusters import DAEMONS, SCRIPT, SlurmCluster, free_port_below_ephemeral, skip_without_bash

from rlactors.run.metrics import read_metrics
from rlactors.trainer.checkpoint import latest_checkpoint

REPO = Path(__file__).resolve().parents[1]
ON_SLURM = ('job.scheduler="slurm"', "job.generator_hosts=0")
COMPARED = ("loss/loss", "rollout/reward_mean", "loss/tokens", "train/grad_norm")


def _overrides(run_dir: Path, *extra: str) -> list[str]:
    """The short run of support.demo_runs (rewards vary), checkpointed at every step, its Monarch
    worker on a free port (the default port would be shared by test sessions of this machine)."""
    return short_run_overrides(WARM_CHECKPOINT, run_dir, "controller.checkpoint_every=1",
                               f"job.worker_port={free_port_below_ephemeral()}", *extra)


@pytest.fixture(scope="module")
def slurm():
    """A cluster of this module's own, named by SLURM_CONF in this process's environment (the runs
    and the Slurm commands here inherit it); stopped afterwards."""
    cluster = SlurmCluster.start()
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("SLURM_CONF", str(cluster.conf))
            yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def cli(slurm):
    """`cli(*args)`: a Cli run on the cluster; a run a failed test left running is killed."""
    runs = []

    def start(*args: str) -> Cli:
        runs.append(Cli(*args))
        return runs[-1]

    yield start
    for run in runs:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()


class Cli:
    """`python -m rlactors.train *args` in a subprocess, its stdout and stderr in files beside
    the run dir."""

    def __init__(self, *args: str):
        self.run_dir = Path(next(a for a in args if a.startswith("controller.run_dir=")).split("=", 1)[1].strip('"'))
        self.worker_port = int(next(a for a in args if a.startswith("job.worker_port=")).split("=", 1)[1])
        self.out, self.err = Path(f"{self.run_dir}.out"), Path(f"{self.run_dir}.err")
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "rlactors.train", *args], stdout=out, stderr=err,
                                         cwd=REPO)

    def wait(self, timeout: float = 300) -> tuple[int, str, str]:
        """The exit code, stdout and stderr."""
        return self.proc.wait(timeout), self.out.read_text(), self.err.read_text()

    def job_id(self, timeout: float = 120) -> str:
        """The id of the Slurm job the run submitted (Monarch names it on stderr)."""
        deadline = time.monotonic() + timeout
        while not (found := re.search(r"SLURM job (\d+) submitted", self.err.read_text())):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.err.read_text()[-3000:]
            time.sleep(0.2)
        return found.group(1)

    def wait_for_step(self, step: int, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while len(read_metrics(self.run_dir)) < step:
            assert self.proc.poll() is None, self.err.read_text()[-3000:]
            assert time.monotonic() < deadline, f"step {step} not logged within {timeout} s"
            time.sleep(0.1)


def _job_processes(job: str) -> list[str]:
    """What still runs of Slurm job `job` of this module's cluster: its slurmstepd and every
    process started inside it (another cluster of this machine numbers its jobs from 1 too)."""
    ours = f"SLURM_CONF={os.environ['SLURM_CONF']}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue  # exited meanwhile
        in_job = cmdline.startswith(f"slurmstepd: [{job}.") or f"SLURM_JOB_ID={job}".encode() in environ
        if ours in environ and in_job:
            found.append(f"{proc.name}: {cmdline[:120]}")
    return found


def _job_state(job: str) -> str:
    """Slurm's state of job `job` ('' once it has left the queue)."""
    return subprocess.run(["squeue", "--noheader", "--states=all", "--job", job, "--format=%T"],
                          capture_output=True, text=True).stdout.strip()


def _assert_released(job: str, timeout: float = 60) -> None:
    """Slurm job `job` holds no node and leaves no process (Slurm's KillWait is 5 s)."""
    deadline = time.monotonic() + timeout
    while True:
        state = _job_state(job)
        left = _job_processes(job)
        if not left and state not in ("PENDING", "RUNNING", "COMPLETING"):
            return
        assert time.monotonic() < deadline, f"job {job} ({state}) not released within {timeout} s: {left}"
        time.sleep(0.5)


def _assert_same_steps(history: list[dict], reference: list[dict]) -> None:
    assert [m["step"] for m in history] == [m["step"] for m in reference]
    for ours, theirs in zip(history, reference):
        for key in COMPARED:
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-7), (ours["step"], key)


def test_two_clusters_of_one_machine_run_jobs_side_by_side_and_stopping_one_leaves_the_other_running(slurm):
    """As two test sessions of one machine: each cluster has its own state dir, ports and daemons."""
    other = SlurmCluster.start()
    try:
        assert other.dir != slurm.dir and not set(other.ports) & set(slurm.ports)
        ours, theirs = slurm.daemons(), other.daemons()
        assert len(ours) == len(theirs) == 3
        for cluster in (slurm, other):
            assert cluster.run("srun", "hostname").strip() == socket.gethostname()
    finally:
        other.stop()
    assert not other.daemons() and not other.dir.exists()
    assert slurm.daemons() == ours
    assert slurm.run("srun", "hostname").strip() == socket.gethostname()


def test_stop_leaves_a_process_that_took_a_dead_daemons_pid_running(tmp_path):
    """The pid files of daemons that died, whose pid another process (another cluster's daemon,
    say) took since: `stop` ends none of it, and removes the state dir."""
    skip_without_bash()
    state_dir = tmp_path / "slurm"
    state_dir.mkdir()
    other = subprocess.Popen(["sleep", "60"])
    try:
        for daemon in DAEMONS:
            (state_dir / f"{daemon}.pid").write_text(f"{other.pid}\n")
        stopped = subprocess.run([SCRIPT, "stop"], env={**os.environ, "RLACTORS_SLURM_DIR": str(state_dir)},
                                 capture_output=True, text=True, timeout=60)
        assert stopped.returncode == 0, stopped.stderr
        assert other.poll() is None and not state_dir.exists()
    finally:
        other.kill()
        other.wait()


def test_a_run_on_slurm_trains_like_one_host_a_scancel_stops_it_and_resume_continues_in_a_new_allocation(
        cli, short_run, tmp_path):
    overrides = _overrides(tmp_path / "run", *ON_SLURM)
    run = cli(*overrides)
    job = run.job_id()
    run.wait_for_step(1)
    with socket.socket() as probe, pytest.raises(OSError, match="Address already in use"):
        probe.bind((socket.gethostname(), run.worker_port))  # the job's worker holds job.worker_port
    subprocess.run(["scancel", job], check=True)
    code, out, err = run.wait()
    assert code == 2, f"exit code {code}; stdout:\n{out[-1500:]}\nstderr:\n{err[-3000:]}"
    node = socket.gethostname()  # the cluster's only node
    on_node = rf"{re.escape(node)} \(pid \d+\)"
    assert re.search(rf"trainer ranks on {on_node}, {on_node}; generator replicas on {on_node}, {on_node}", out), out
    done = len(read_metrics(run.run_dir))  # step 1, or 2 if it completed before the scancel
    last = latest_checkpoint(run.run_dir / "checkpoints")
    assert done < 3 and last is not None and last.name == f"step_{done:08d}"
    assert err.strip().splitlines()[-1] == (f"error: step {done + 1}: the Slurm job {job} ended: CANCELLED; the last "
                                            f"complete checkpoint is {last}; continue with --resume"), err[-3000:]
    assert "Traceback" not in err
    _assert_released(job)

    resumed = cli("--resume", *overrides)
    code, out, err = resumed.wait()
    assert code == 0, err[-3000:]
    assert f"resumed from {last} at step {done}" in out
    assert resumed.job_id() != job
    _assert_released(resumed.job_id())  # the run ended: its allocation with it
    _assert_same_steps(read_metrics(run.run_dir), read_metrics(short_run[0]))  # the same run on this host
    for slurm_job in (job, resumed.job_id()):  # the workers' output
        assert list((run.run_dir / "slurm").glob(f"slurm_{slurm_job}_rlactors_*.out"))


def test_ctrl_c_saves_the_last_step_and_releases_the_allocation(cli, tmp_path):
    run = cli(*_overrides(tmp_path / "run", *ON_SLURM))
    job = run.job_id()
    run.wait_for_step(1)
    run.proc.send_signal(signal.SIGINT)  # the controller only, as Ctrl-C on a login node
    code, _, err = run.wait()
    assert code == 130, err[-3000:]
    assert "interrupted after step" in err and "continue with --resume" in err
    _assert_released(job)


def test_ctrl_c_while_the_job_waits_in_the_queue_cancels_it(cli, tmp_path):
    holder = subprocess.run(["sbatch", "--parsable", "--exclusive", "--output=/dev/null", "--wrap=sleep 300"],
                            capture_output=True, text=True, check=True).stdout.strip()  # takes the only node
    try:
        run = cli(*_overrides(tmp_path / "run", *ON_SLURM))
        job = run.job_id()
        assert _job_state(job) == "PENDING"
        run.proc.send_signal(signal.SIGINT)
        code, _, err = run.wait()
        assert code == 130, err[-3000:]
        assert err.strip().splitlines()[-1] == ("interrupted before step 1 completed: nothing is saved; start the "
                                                "run again (without --resume)")
        _assert_released(job)
    finally:
        subprocess.run(["scancel", holder], check=True)
    _assert_released(holder)


def test_a_run_that_fails_on_its_hosts_releases_the_allocation(cli, tmp_path):
    """The job's actor procs (trainer ranks and replicas) SIGKILLed after step 1, as when the node's
    processes are lost: the run stops naming the dead proc, and the allocation is released."""
    run = cli(*_overrides(tmp_path / "run", *ON_SLURM))
    job = run.job_id()
    run.wait_for_step(1)
    procs = [int(line.split(":", 1)[0]) for line in _job_processes(job) if "bootstrap_main" in line]
    assert procs, _job_processes(job)
    for pid in procs:
        os.kill(pid, signal.SIGKILL)
    code, _, err = run.wait()
    assert code == 2 and "exited (signal 9)" in err.strip().splitlines()[-1], err[-3000:]
    _assert_released(job)


def test_a_job_slurm_refuses_stops_the_run_with_sbatchs_reason(cli, tmp_path):
    code, _, err = cli(*_overrides(tmp_path / "run", 'job.partition="nowhere"', *ON_SLURM)).wait()
    assert code == 2
    assert err.strip().splitlines()[-1] == ("error: job.scheduler: the Slurm job did not start: Failed to submit "
                                            "SLURM job: sbatch: error: invalid partition specified: nowhere sbatch: "
                                            "error: Batch job submission failed: Invalid partition name specified")
