"""Helpers of the fault-injection suite: the CLI in a subprocess, small run configs, /proc reads, a
controller that SIGKILLs its trainer's ranks, and one whose trainer runs out of GPU memory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from gpu_full import GpuFullTrainer
from monarch.actor import this_host
from support.stand_ins import ActorWith

from rlactors.run.controller import Controller
from rlactors.run.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
RUN_PY = REPO / "examples" / "alphabet_sort" / "run.py"
FAULTS_DIR = Path(__file__).resolve().parent
REPORT_ENV = "RLACTORS_FAULTS_REPORT"


def run_cli(*args: str, timeout: float = 240.0) -> subprocess.CompletedProcess:
    """Runs examples/alphabet_sort/run.py in a subprocess (tests/faults importable for fault envs)."""
    return subprocess.run([sys.executable, str(RUN_PY), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=cli_env())


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(FAULTS_DIR), env.get("PYTHONPATH")) if p)
    env.pop(REPORT_ENV, None)
    return env


def small_run_overrides(ckpt: Path, run_dir: Path, *extra: str) -> list[str]:
    """A controller run that takes seconds on 2 CPU cores: 1 trainer rank, 1 replica, one short
    turn of FaultyEnv (faults off unless `extra` sets env.args), no evaluation (the CPU demo
    config's evals would share the replicas with the faults under test)."""
    return [f'model.path="{ckpt}"', f'controller.run_dir="{run_dir}"', "controller.steps=3",
            "controller.checkpoint_every=1", "controller.eval_every=0", "controller.log_samples=false",
            "trainer.ranks=1",
            "trainer.lr=1e-3", "generator.replicas=1", "generator.max_model_len=256",
            "generator.kv_cache_tokens=4096", "rollout.prompts_per_step=2", "rollout.group_size=2",
            "rollout.max_turns=1", "rollout.max_tokens_per_turn=8", "rollout.max_total_tokens=256",
            "rollout.keep_zero_variance_groups=true", "batcher.row_tokens=256",
            'env.name="fault_envs:FaultyEnv"', *extra]


def rss_mb(pid: int) -> float:
    """Resident memory of a process, in MB (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise ValueError(f"no VmRSS for pid {pid}")


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid`, oldest first (Linux /proc)."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        if int(fields[1]) == pid:
            children.append((int(fields[19]), int(entry.name)))  # (start time, pid)
    return [p for _, p in sorted(children)]


def wait_until(condition, timeout: float, interval: float = 0.02, what: str = "condition"):
    """Polls `condition()` until it returns a truthy value (returned); fails after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout} s")
        time.sleep(interval)


class CliProcess:
    """run.py in a subprocess whose output lines are collected with their arrival time."""

    def __init__(self, *args: str, new_session: bool = False):
        """`new_session`: in a process group of its own, which `interrupt` signals as a terminal's
        Ctrl-C does."""
        self.proc = subprocess.Popen([sys.executable, str(RUN_PY), *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, cwd=REPO, env=cli_env(),
                                     start_new_session=new_session)
        self.lines: dict[str, list[tuple[float, str]]] = {"stdout": [], "stderr": []}
        self._readers = [threading.Thread(target=self._read, args=(name,), daemon=True) for name in self.lines]
        for reader in self._readers:
            reader.start()

    def _read(self, name: str) -> None:
        for line in getattr(self.proc, name):
            self.lines[name].append((time.monotonic(), line.rstrip("\n")))

    def first_line_after(self, name: str, start: float, contains: str) -> float | None:
        """Arrival time of the first line of `name` after `start` that holds `contains`."""
        return next((t for t, line in self.lines[name] if t >= start and contains in line), None)

    def interrupt(self) -> None:
        """SIGINT to the run's whole process group (its actor procs too), as Ctrl-C sends it."""
        os.killpg(self.proc.pid, signal.SIGINT)

    def wait(self, timeout: float = 240.0) -> int:
        code = self.proc.wait(timeout)
        for reader in self._readers:
            reader.join(10)
        return code

    def text(self, name: str) -> str:
        return "\n".join(line for _, line in self.lines[name])


class Spinners:
    """`n` processes that spin on the CPU (a busy machine), stopped on exit from the `with`."""

    def __init__(self, n: int):
        self.n = n
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Spinners:
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.n)]
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait()


async def kill_replica(router, index: int) -> float:
    """SIGKILLs generator replica `index`'s proc; returns when, by time.monotonic()."""
    stats = await router.stats.call_one()
    os.kill(stats["replicas"][index]["engine"]["pid"], signal.SIGKILL)
    return time.monotonic()


class TrainerKilledAsStepsBegin(Controller):
    """SIGKILLs a trainer rank (rank 0, 1, ... in turn) as each step of `kill_at` begins, its first
    attempt only. Keeps, per kill, the step records written before it and when it came (`killed`:
    step -> (records, time.monotonic())); and when each rebuilt trainer was ready (`rebuilt_at`)
    and completed its first step (`stepped_at`)."""

    def __init__(self, config, kill_at: tuple[int, ...]):
        super().__init__(config)
        self.kill_at, self.killed = kill_at, {}
        self.rebuilt_at: list[float] = []
        self.stepped_at: list[float] = []

    async def _train_step(self, metrics_log):
        step = self.step + 1
        if step in self.kill_at and step not in self.killed:
            rank = len(self.killed) % self.config.trainer.ranks
            self.killed[step] = (read_metrics(self.run_dir.path), time.monotonic())
            os.kill(next(p.pid for p in self.meshes.watcher.procs if p.name == f"trainer rank {rank}"), signal.SIGKILL)
        metrics = await super()._train_step(metrics_log)
        if len(self.stepped_at) < len(self.rebuilt_at):
            self.stepped_at.append(time.monotonic())
        return metrics

    async def recover_trainer(self, cause: str) -> int:
        step = await super().recover_trainer(cause)
        self.rebuilt_at.append(time.monotonic())
        return step



class TrainerOutOfMemoryAtStep(Controller):
    """The trainer's forward_backward calls of step `oom_step` go to a GpuFullTrainer named as the
    trainer is, in a proc of its own: they fail as Monarch reports a trainer rank's CUDA OOM."""

    def __init__(self, config, oom_step: int):
        super().__init__(config)
        self.oom_step, self._full_procs = oom_step, None

    async def start(self) -> None:
        await super().start()
        self._full_procs = this_host().spawn_procs(per_host={"gpus": 1})
        full = self._full_procs.spawn("policy_trainer", GpuFullTrainer).forward_backward
        real = self.trainer.forward_backward

        def call(*args):
            return (full if self.step + 1 == self.oom_step else real).call(*args)

        self.trainer = ActorWith(self.trainer, forward_backward=SimpleNamespace(call=call))

    async def _stop(self) -> None:
        await super()._stop()
        if self._full_procs is not None:
            await self._full_procs.stop()
