"""scripts/gpu_suite.py on CPU: its groups name tests that exist, a group stopped at its timeout
takes every process it started with it and says which test was running, and on a machine without
NVIDIA's tools the suite stops with one line saying so."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
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


def test_each_group_appends_its_row_as_it_ends(tmp_path, monkeypatch):
    """A suite stopped partway (a device machine taken back) keeps the rows of the groups that
    ended: the second group's test finds the first group's row already written."""
    header = gpu_suite.row([*gpu_suite.STAMP, *gpu_suite.COLUMNS])
    assert header in gpu_suite.RESULTS.read_text().splitlines()  # the table a run appends to
    results = tmp_path / "gpu_suite.md"
    results.write_text(f"# title\n\n{header}\n|---|\n")
    first, second = tmp_path / "test_first.py", tmp_path / "test_second.py"
    first.write_text("def test_passes():\n    pass\n")
    second.write_text("from pathlib import Path\n\n\ndef test_the_first_groups_row_is_written():\n"
                      f"    assert '| 1gpu | first |' in Path({str(results)!r}).read_text()\n\n\n"
                      "def test_fails():\n    assert False\n")
    monkeypatch.setattr(gpu_suite, "RESULTS", results)
    monkeypatch.setattr(gpu_suite, "SINGLE", [gpu_suite.Group("first", [str(first)], 1),
                                              gpu_suite.Group("second", [str(second)], 1)])
    monkeypatch.setattr(gpu_suite, "gpu_names", lambda: ["Fake GPU, 1 MiB"])
    monkeypatch.setattr(sys, "argv", ["gpu_suite.py", "1gpu"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(SystemExit) as stopped:
        gpu_suite.main()
    assert stopped.value.code == 1  # a group failed
    rows = [line.split(" | ") for line in results.read_text().splitlines()[-2:]]
    assert [r[1] for r in rows] == ["1 x Fake GPU, 1 MiB"] * 2
    assert [(r[4], r[5], r[7], r[8], r[9], r[12]) for r in rows] == [
        ("1gpu", "first", "1", "0", "0", "ok |"), ("1gpu", "second", "1", "1", "0", "FAIL |")]
