"""A sandbox for untrusted Python: the code a policy writes, run by an env or an agent's tool.

Each run is a fresh Python process under bubblewrap (`bwrap`, Debian's `bubblewrap` package) in
new user, PID, network, mount, IPC, UTS and cgroup namespaces. It sees a read-only /usr (and the
interpreter's own prefix), its files read-only in /sandbox, a /proc and /dev of its own, and a
size-limited tmpfs at /tmp as its working directory: nothing else of the machine (no /etc, /home,
the run dir or other sandboxes). It has no network (a loopback that is down) and no capabilities.
Inside, rlimits bound its CPU seconds, address space per process, processes and threads (counted in
its own user namespace: a fork bomb runs out of its own share only), file size and open files.
The caller bounds wall time and output, and ends the whole sandbox when either runs out: killing
bwrap ends its PID namespace, and every process in it. Run as root, bwrap runs as `nobody`
(uid 65534), as the kernel exempts root from the process limit.

Where bwrap is missing or the kernel refuses it unprivileged user namespaces, `Sandbox()` raises
SandboxUnavailable saying what to install or allow: code is never run unconfined.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from rlactors.config import ConfigError

NOBODY = 65534  # the uid (and gid) bwrap runs as when started by root
SCRIPT = "main.py"
STDERR_TAIL = 2000  # characters of stderr kept in a result
# Sets the limits that must count inside the sandbox (processes: per user namespace), then runs the script.
_LAUNCHER = """\
import os, resource as r, sys
cpu, memory, processes, file_bytes, files = map(int, sys.argv[1:6])
for limit, value in ((r.RLIMIT_CPU, (cpu, cpu + 1)), (r.RLIMIT_AS, (memory, memory)),
                     (r.RLIMIT_NPROC, (processes, processes)), (r.RLIMIT_FSIZE, (file_bytes, file_bytes)),
                     (r.RLIMIT_NOFILE, (files, files)), (r.RLIMIT_CORE, (0, 0))):
    r.setrlimit(limit, value)
os.execv(sys.executable, [sys.executable, "-E", "-s", "-S", "-B", *sys.argv[6:]])
"""


class SandboxUnavailable(ConfigError):
    """This machine cannot isolate a program (no bwrap, or no user namespaces for it): a run whose
    env needs the sandbox stops before it starts, with this one line."""


class Outcome(str, enum.Enum):
    OK = "ok"  # exited 0
    ERROR = "error"  # exited non-zero (an exception: see stderr)
    TIMEOUT = "timeout"  # ran past its wall time or CPU seconds
    MEMORY = "memory"  # ran out of its address space (MemoryError)
    OUTPUT_LIMIT = "output_limit"  # wrote more than its output limit
    KILLED = "killed"  # ended by a signal it did not get from the sandbox (it killed itself)


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    cpu_s: int = 10
    memory_bytes: int = 256 << 20  # address space of each process
    processes: int = 16  # processes and threads, the program's first one included
    output_bytes: int = 1 << 20  # stdout and stderr together
    disk_bytes: int = 16 << 20  # the tmpfs at /tmp, and the largest file it may write
    open_files: int = 64

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "memory_bytes", "processes", "output_bytes", "disk_bytes", "open_files"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class SandboxResult:
    outcome: Outcome
    exit_code: int | None  # the program's; negative: the signal that ended it; None when the sandbox ended it
    stdout: str  # at most the output limit
    stderr_tail: str  # the last STDERR_TAIL characters
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK

    def describe(self) -> str:
        """One line for a rollout's error or a tool's reply: the outcome and the end of stderr."""
        last = self.stderr_tail.strip().splitlines()[-1:] or [""]
        code = "" if self.exit_code is None else f" (exit {self.exit_code})"
        return f"{self.outcome.value}{code}{': ' + last[0] if last[0] else ''}"


class Sandbox:
    """`await sandbox.run(code, files=..., stdin=...)`: `code` as /sandbox/main.py, at most
    `max_parallel` at a time (a run waiting for its turn has not started its wall time)."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), max_parallel: int = 4,
                 python: str | None = None) -> None:
        self.limits = limits
        self.python = python or shutil.which("python3", path="/usr/bin:/bin") or sys.executable
        self._slots = asyncio.Semaphore(max_parallel)
        check_sandbox(self.python)

    async def run(self, code: str, files: Mapping[str, str] | None = None, stdin: str = "") -> SandboxResult:
        async with self._slots:
            with tempfile.TemporaryDirectory(prefix="rlactors-sandbox-") as src:
                _write_files(Path(src), {**(files or {}), SCRIPT: code})
                return await _run(_command(self.python, src, self.limits), self.limits, stdin.encode())


@functools.cache
def check_sandbox(python: str) -> None:
    """Raises SandboxUnavailable, saying why, unless a trivial program runs in the sandbox."""
    if shutil.which("bwrap") is None:
        raise SandboxUnavailable("the code sandbox needs bubblewrap: install it (Debian/Ubuntu: apt-get install "
                                 "bubblewrap; Fedora: dnf install bubblewrap)")
    with tempfile.TemporaryDirectory(prefix="rlactors-sandbox-") as src:
        _write_files(Path(src), {SCRIPT: "print('ok')"})
        done = subprocess.run(_command(python, src, SandboxLimits()), capture_output=True, timeout=60,
                              **_as_user())
    if done.returncode != 0 or done.stdout != b"ok\n":
        reason = " ".join(done.stderr.decode(errors="replace").split()) or f"exit code {done.returncode}"
        raise SandboxUnavailable(f"bwrap cannot start a sandbox here ({reason}): it needs unprivileged user "
                                 "namespaces (sysctl kernel.unprivileged_userns_clone=1; on Ubuntu also "
                                 f"kernel.apparmor_restrict_unprivileged_userns=0) and {python} readable by uid "
                                 f"{os.geteuid() or NOBODY}")


def _as_user() -> dict[str, object]:
    """Popen arguments that run bwrap unprivileged: as nobody when this process is root."""
    return {"user": NOBODY, "group": NOBODY, "extra_groups": []} if os.geteuid() == 0 else {}


def _write_files(src: Path, files: Mapping[str, str]) -> None:
    for name, text in files.items():
        path = src / name
        if path.resolve().parent != src.resolve():
            raise ValueError(f"sandbox file names are plain names in its directory, got {name!r}")
        path.write_text(text)
    if os.geteuid() == 0:
        for path in (src, *src.iterdir()):
            os.chown(path, NOBODY, NOBODY)


def _command(python: str, src: str, limits: SandboxLimits) -> list[str]:
    python = os.path.realpath(python)
    prefix = os.path.dirname(os.path.dirname(python))  # <prefix>/bin/python3
    command = ["bwrap", "--unshare-all", "--unshare-user", "--cap-drop", "ALL", "--die-with-parent", "--new-session",
               "--hostname", "sandbox", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp",
               "--setenv", "LANG", "C.UTF-8", "--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(top):
            command += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            command += ["--ro-bind", top, top]
    if not prefix.startswith("/usr/"):
        command += ["--ro-bind", prefix, prefix]
    command += ["--proc", "/proc", "--dev", "/dev", "--size", str(limits.disk_bytes), "--tmpfs", "/tmp",
                "--ro-bind", src, "/sandbox", "--chdir", "/tmp", "--", python, "-I", "-S", "-B", "-c", _LAUNCHER,
                str(limits.cpu_s), str(limits.memory_bytes), str(limits.processes + 1),  # + bwrap's init
                str(limits.disk_bytes), str(limits.open_files), f"/sandbox/{SCRIPT}"]
    return command


async def _run(command: list[str], limits: SandboxLimits, stdin: bytes) -> SandboxResult:
    start = time.monotonic()
    proc = await asyncio.create_subprocess_exec(*command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                stderr=subprocess.PIPE, start_new_session=True, **_as_user())
    output = _Output(limits.output_bytes)
    readers = [asyncio.ensure_future(output.read(proc.stdout, output.stdout)),
               asyncio.ensure_future(output.read(proc.stderr, output.stderr))]
    feeding = asyncio.ensure_future(_feed(proc.stdin, stdin))
    ended = asyncio.ensure_future(proc.wait())
    try:
        await asyncio.wait([ended, output.over], timeout=limits.wall_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        timed_out = not ended.done() and not output.over.done()
        if not ended.done():
            _kill(proc)
        await ended
        await asyncio.gather(*readers, feeding, return_exceptions=True)
    stderr = output.stderr.decode(errors="replace")[-STDERR_TAIL:]
    code = proc.returncode
    if output.over.done() or timed_out:
        outcome, code = Outcome.OUTPUT_LIMIT if output.over.done() else Outcome.TIMEOUT, None
    elif code == 0:
        outcome = Outcome.OK
    elif code > 128:  # bwrap reports a signal that ended the program as 128 + its number
        code = -(code - 128)
        outcome = Outcome.TIMEOUT if code == -signal.SIGXCPU else Outcome.KILLED  # SIGXCPU: out of CPU seconds
    elif stderr.rstrip().rsplit("\n", 1)[-1].startswith("MemoryError"):
        outcome = Outcome.MEMORY
    else:
        outcome = Outcome.ERROR
    return SandboxResult(outcome, code, output.stdout.decode(errors="replace"), stderr, time.monotonic() - start)


def _kill(proc: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # bwrap; its PID namespace, and all in it, ends with it
    except ProcessLookupError:
        pass


async def _feed(pipe: asyncio.StreamWriter, data: bytes) -> None:
    try:
        pipe.write(data)
        await pipe.drain()
    finally:
        pipe.close()


class _Output:
    """stdout and stderr as they come, up to `limit` bytes together; `over` is set beyond it."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.stdout, self.stderr = bytearray(), bytearray()
        self.over: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def read(self, stream: asyncio.StreamReader, into: bytearray) -> None:
        while chunk := await stream.read(1 << 16):
            room = self.limit - len(self.stdout) - len(self.stderr)
            into += chunk[:max(room, 0)]
            if len(chunk) > room and not self.over.done():
                self.over.set_result(None)
