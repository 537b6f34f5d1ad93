"""One-machine Slurm clusters of scripts/slurm_cluster.sh for tests: each in a state dir of its
own (a fresh temp dir) on free ports of its own, so that test sessions on one machine never share
a cluster, and stopping one stops only its own daemons."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "slurm_cluster.sh"
CANNOT_INSTALL = 3  # the script's exit code where this machine cannot have Slurm
DAEMONS = ("munged", "slurmctld", "slurmd")


class SlurmCluster:
    """A started cluster; `env` is the environment its Slurm commands (sbatch, squeue, srun) need."""

    def __init__(self, state_dir: Path, ports: tuple[int, int]):
        self.dir = state_dir
        self.ports = ports  # slurmctld's, slurmd's
        self.conf = state_dir / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf), "RLACTORS_SLURM_DIR": str(state_dir),
                    "RLACTORS_SLURM_CTLD_PORT": str(ports[0]), "RLACTORS_SLURM_D_PORT": str(ports[1])}

    @classmethod
    def start(cls) -> SlurmCluster:
        """A new cluster; skips the test where this machine cannot have one (no Linux, bash, or
        Slurm and no way to install it)."""
        skip_without_bash()
        ctld_port = free_port_below_ephemeral()
        while (d_port := free_port_below_ephemeral()) == ctld_port:
            pass
        cluster = cls(Path(tempfile.mkdtemp(prefix="rlactors-slurm-")), (ctld_port, d_port))
        started = cluster._script("start", timeout=900)
        if started.returncode == 0:
            return cluster
        cluster.stop()
        if started.returncode == CANNOT_INSTALL:
            pytest.skip(started.stderr.strip().splitlines()[-1])
        raise AssertionError(f"the Slurm cluster did not start: {started.stderr}")

    def stop(self) -> None:
        """Cancels its jobs, stops its daemons (by the pid files of its dir) and removes its dir."""
        stopped = self._script("stop", timeout=300)
        assert stopped.returncode == 0, stopped.stderr

    def daemons(self) -> dict[str, int]:
        """The pid of each of its daemons that runs, found by its command line (which names a file
        of its state dir), not by its pid file."""
        found = {}
        for proc in Path("/proc").iterdir():
            try:
                args = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue  # exited meanwhile, or not a process
            if proc.name.isdigit() and Path(args[0]).name in DAEMONS and any(str(self.dir) in arg for arg in args):
                found[Path(args[0]).name] = int(proc.name)
        return found

    def run(self, *command: str) -> str:
        """The stdout of a Slurm command run against this cluster."""
        return subprocess.run(command, env=self.env, capture_output=True, text=True, check=True, timeout=120).stdout

    def _script(self, command: str, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run([SCRIPT, command], env=self.env, capture_output=True, text=True, timeout=timeout)


def skip_without_bash() -> None:
    if shutil.which("bash") is None or not sys.platform.startswith("linux"):
        pytest.skip("the Slurm tests need Linux and bash")


def free_port_below_ephemeral() -> int:
    """A port free now, below the kernel's ephemeral range (net.ipv4.ip_local_port_range), from
    which every outgoing connection takes its source port: none takes this one before the daemon
    meant to listen on it binds it."""
    first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.sample(range(first_ephemeral // 2, first_ephemeral), 100):
        with socket.socket() as probe:
            try:
                probe.bind(("", port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free port in {first_ephemeral // 2}..{first_ephemeral - 1}")
