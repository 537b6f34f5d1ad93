"""The code sandbox (rlactors.envs.sandbox): every escape attempt is contained, with a result that says
how the program ended, and leaves nothing behind; two sandboxes never see each other."""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path

import pytest

from rlactors.config import ConfigError
from rlactors.envs import sandbox as sandbox_module
from rlactors.envs.sandbox import Outcome, Sandbox, SandboxLimits, SandboxUnavailable

LIMITS = SandboxLimits(wall_s=1.5, cpu_s=5, memory_bytes=128 << 20, processes=8, output_bytes=1 << 20,
                       disk_bytes=1 << 20)


@pytest.fixture(scope="module")
def box():
    try:
        return Sandbox(LIMITS)
    except SandboxUnavailable as e:
        pytest.skip(f"no sandbox on this machine: {e}")


def run(box, code, **kwargs):
    return asyncio.run(box.run(code, **kwargs))


def alive_with(marker: str) -> list[int]:
    """Pids of the processes whose command line holds `marker`."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker.encode() in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            pass
    return pids


def test_a_program_runs_with_its_files_stdin_and_a_scratch_dir(box):
    code = ("import helper, sys\nopen('scratch', 'w').write(sys.stdin.read())\n"
            "print(helper.twice(open('scratch').read()))")
    result = run(box, code, files={"helper.py": "def twice(s):\n    return s * 2\n"}, stdin="ab")
    assert (result.outcome, result.exit_code, result.stdout, result.stderr_tail) == (Outcome.OK, 0, "abab\n", "")
    assert result.describe() == "ok (exit 0)"
    failed = run(box, "raise ValueError('wrong')")
    assert (failed.outcome, failed.exit_code) == (Outcome.ERROR, 1)
    assert failed.describe() == "error (exit 1): ValueError: wrong"


def test_a_fork_bomb_runs_out_of_its_own_processes_and_leaves_none_behind(box):
    marker = f"rlactors-bomb-{uuid.uuid4().hex}"
    code = ("import os, sys\nwhile True:\n    if os.fork() == 0:\n"
            f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])")
    result = run(box, code)
    assert result.outcome is Outcome.ERROR and "BlockingIOError" in result.describe()
    assert alive_with(marker) == []  # its sleepers ended with its PID namespace
    assert run(box, "print(1)").ok  # and the next program runs


def test_an_endless_loop_times_out_on_wall_time_or_cpu_seconds(box):
    result = run(box, "while True:\n    pass")
    assert (result.outcome, result.exit_code) == (Outcome.TIMEOUT, None) and result.wall_s >= LIMITS.wall_s
    cpu_bound = asyncio.run(Sandbox(SandboxLimits(wall_s=300, cpu_s=1)).run("while True:\n    pass"))
    assert (cpu_bound.outcome, cpu_bound.exit_code) == (Outcome.TIMEOUT, -24)  # SIGXCPU
    sleeper = run(box, "import time\nprint('started', flush=True)\ntime.sleep(60)")
    assert sleeper.outcome is Outcome.TIMEOUT and sleeper.stdout == "started\n"


def test_a_memory_hog_gets_a_memory_error(box):
    result = run(box, "hog = bytearray(1 << 30)")
    assert result.outcome is Outcome.MEMORY and result.describe() == "memory (exit 1): MemoryError"


@pytest.mark.parametrize("path", ["/etc/passwd", "/root", "/home", "RUN_DIR", "HERE"])
def test_files_outside_its_own_are_not_there(box, tmp_path, path):
    (tmp_path / "secret.txt").write_text("run state")
    path = {"RUN_DIR": str(tmp_path / "secret.txt"), "HERE": __file__}.get(path, path)
    result = run(box, f"import os\nprint(os.listdir({path!r}) if os.path.isdir({path!r}) else open({path!r}).read())")
    assert result.outcome is Outcome.ERROR and "FileNotFoundError" in result.describe(), result
    root = run(box, "import os\nprint(*os.listdir('/'))").stdout.split()
    assert set(root) == {d for d in os.listdir("/") if d in ("bin", "lib", "lib64", "lib32", "sbin", "usr")} | {
        "dev", "proc", "sandbox", "tmp"} | ({"root"} if str(Path(box.python).resolve()).startswith("/root/") else set())
    read_only = run(box, "open('/sandbox/main.py', 'w')")
    assert "Read-only file system" in read_only.describe()
    too_big = run(box, "open('/tmp/big', 'wb').write(bytes(2 << 20))")  # beyond disk_bytes
    assert too_big.outcome is Outcome.ERROR and "File too large" in too_big.describe()


def test_there_is_no_network(box):
    code = "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)"
    result = run(box, code)
    assert result.outcome is Outcome.ERROR and "Network is unreachable" in result.describe()
    listen = run(box, "import socket\ns = socket.socket()\ns.bind(('0.0.0.0', 0))\ns.listen()\nprint('bound')")
    assert listen.ok  # a server of its own is fine: no one outside can reach it


def test_100_mb_of_output_is_cut_at_the_limit(box):
    result = run(box, "import sys\nfor _ in range(1600):\n    sys.stdout.write('x' * 65536)")
    assert (result.outcome, result.exit_code) == (Outcome.OUTPUT_LIMIT, None)
    assert len(result.stdout) == LIMITS.output_bytes


def test_killing_its_parent_or_this_process_reaches_neither(box):
    code = (f"import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('parent lives', flush=True)\n"
            f"os.kill({os.getpid()}, signal.SIGKILL)")
    result = run(box, code)
    assert result.stdout == "parent lives\n"  # its parent is the sandbox's init, which it cannot kill
    assert result.outcome is Outcome.ERROR and "ProcessLookupError" in result.describe()  # this one it cannot see
    everyone = run(box, "import os, signal\nos.kill(-1, signal.SIGKILL)")
    assert everyone.outcome is Outcome.ERROR and "ProcessLookupError" in everyone.describe()
    suicide = run(box, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    assert (suicide.outcome, suicide.exit_code) == (Outcome.KILLED, -9)


def test_concurrent_sandboxes_do_not_see_each_other(box):
    async def both():
        writer = box.run("import time\nopen('/tmp/mine', 'w').write('a')\nprint(len(__import__('os').listdir('/proc')))"
                         "\ntime.sleep(0.5)")
        reader = box.run("import os, time\ntime.sleep(0.2)\nprint(os.path.exists('/tmp/mine'), "
                         "sorted(p for p in os.listdir('/proc') if p.isdigit()))")
        return await asyncio.gather(writer, reader)

    writer, reader = asyncio.run(both())
    assert writer.ok and reader.stdout == "False ['1', '2']\n"  # its own init and itself


def test_without_bubblewrap_the_sandbox_refuses_to_run_anything(monkeypatch):
    monkeypatch.setattr(sandbox_module.shutil, "which", lambda name, path=None: None)
    with pytest.raises(SandboxUnavailable, match=r"needs bubblewrap: install it \(Debian/Ubuntu: apt-get install"):
        sandbox_module.check_sandbox.__wrapped__("/usr/bin/python3")
    assert issubclass(SandboxUnavailable, ConfigError)  # a run stops with one `error:` line, exit code 2


def test_limits_are_checked():
    with pytest.raises(ValueError, match=r"SandboxLimits\.wall_s must be > 0, got 0"):
        SandboxLimits(wall_s=0)
