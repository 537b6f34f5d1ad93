"""scripts/gpu_suite.py on CPU: its groups name tests that exist, a group stopped at its timeout
takes every process it started with it and says which test was running, and on a machine without
NVIDIA's tools the suite stops with one line saying so."""

import os
import subprocess
import sys
import time
from pathlib import Path

from support.linux import running

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "scripts"))  # as when run from there
import gpu_suite  # noqa: E402

HOLDER = """
import subprocess, time
def test_holds_a_process():
    child = subprocess.Popen(["sleep", "600"])
    open({pid_file!r}, "w").write(str(child.pid))
    time.sleep(600)
"""


def test_every_group_names_test_files_of_the_repository():
    for group in [*gpu_suite.SINGLE, *gpu_suite.DOUBLE]:
        paths = [a.removeprefix("--ignore=") for a in group.args if "tests" in a]
        assert paths, group.name
        assert all((ROOT / p).exists() for p in paths), (group.name, paths)


def test_without_nvidia_smi_the_suite_stops_with_one_line(tmp_path):
    done = subprocess.run([sys.executable, "scripts/gpu_suite.py", "1gpu"], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "PATH": str(tmp_path)})  # no nvidia-smi on it
    assert (done.returncode, done.stdout) == (1, ""), done
    assert done.stderr == ('error: nvidia-smi not found: the GPU suite runs on a machine with NVIDIA GPUs '
                           '(docs/gpu.md)\n'), done.stderr


def test_a_group_past_its_timeout_takes_the_processes_it_started_and_names_the_running_test(tmp_path):
    pid_file = tmp_path / "child.pid"
    test_file = tmp_path / "test_holder.py"
    test_file.write_text(HOLDER.format(pid_file=str(pid_file)))
    # A busy machine may not reach the test within the first timeout: then a longer one.
    for timeout_s in (6, 20, 60, 180):
        group = gpu_suite.run_group(gpu_suite.Group("holder", [str(test_file)], 1), "", None, timeout_s)
        if pid_file.exists():
            break
    assert pid_file.exists(), group.log
    assert group.returncode == -1 and group.log.endswith(f"timed out after {timeout_s} s"), group.log
    assert "test_holder.py::test_holds_a_process" in group.log, group.log
    assert gpu_suite.failed(group, "1gpu")
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 30
    while running(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    if running(child):
        os.kill(child, 9)
        raise AssertionError(f"the group's process {child} outlived its timeout")


def test_a_run_appends_one_row_per_group_to_the_results_table(tmp_path, monkeypatch):
    header = gpu_suite.row([*gpu_suite.STAMP, *gpu_suite.COLUMNS])
    assert header in gpu_suite.RESULTS.read_text().splitlines()  # the table a run appends to
    results = tmp_path / "gpu_suite.md"
    results.write_text(f"# title\n\n{header}\n|---|\n")
    monkeypatch.setattr(gpu_suite, "RESULTS", results)
    groups = [gpu_suite.Group("kernels", [], 1, {"passed": 3, "errors": 0}, 12.4, returncode=0),
              gpu_suite.Group("system", [], 1, {"passed": 1, "failed": 1, "errors": 0}, 30.0, returncode=1)]
    gpu_suite.append_rows(groups, "1gpu", ["2026-12-01", "1 x GPU", "abc1234", "`cmd`"])
    assert results.read_text().splitlines()[-2:] == [
        "| 2026-12-01 | 1 x GPU | abc1234 | `cmd` | 1gpu | kernels | 1 | 3 | 0 | 0 | 0 | 12 | ok |",
        "| 2026-12-01 | 1 x GPU | abc1234 | `cmd` | 1gpu | system | 1 | 1 | 1 | 0 | 0 | 30 | FAIL |"]
