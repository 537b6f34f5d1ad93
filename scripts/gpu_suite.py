"""The GPU test suite in groups, each in a pytest process of its own, on a GPU machine.

    python scripts/gpu_suite.py 1gpu   # every test that runs on one GPU (one H100 80 GB is enough)
    python scripts/gpu_suite.py 2gpu   # the tests that need two GPUs (NCCL, FSDP2, tensor and expert parallel)
    python scripts/gpu_suite.py 1gpu --groups kernels "vllm engine"   # some groups only

A group is a pytest process in a session of its own, so nothing one group leaves in memory reaches
the next, and a group stopped at its timeout takes its processes with it; inside a group,
tests/conftest.py checks that each module gives the GPU memory back. `1gpu` runs its groups
side by side when more GPUs are visible (one GPU each, by CUDA_VISIBLE_DEVICES); `2gpu` runs its
groups one after another on the first two GPUs, and fails a test that skips for want of GPUs.
Appends a row per group to benchmarks/results/gpu_suite.md with the machine, date and commit as
the group ends (a suite stopped partway keeps the rows of the groups that ended), prints a table
of groups, counts and seconds at the end, and exits non-zero when any group failed. Expects vLLM
and Monarch importable (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import datetime
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "gpu_suite.md"
GROUP_TIMEOUT_S = 600
# Verbose, so a group's log names each test as it starts: a group stopped at its timeout shows
# which test was running; a test still running after STACKS_AFTER_S prints every thread's stack.
STACKS_AFTER_S = 300
PYTEST = ["-m", "pytest", "-v", "-p", "no:cacheprovider", "--tb=short", "-rfEs", "--durations=10",
          "-o", f"faulthandler_timeout={STACKS_AFTER_S}"]


@dataclass
class Group:
    name: str
    args: list[str]  # test paths and selections
    gpus: int
    counts: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    returncode: int | None = None
    log: str = ""


# Marks (pyproject.toml): `gpu` needs CUDA; `two_gpus` / `four_gpus` need that many.
ONE = ["-m", "gpu and not two_gpus and not four_gpus"]
# Each group stays well under GROUP_TIMEOUT_S on one H100.
SINGLE = [
    Group("kernels", [*ONE, "tests/models", "tests/on_policy", "tests/trainer"], 1),
    Group("vllm engine", [*ONE, "tests/engines/test_vllm_engine.py", "tests/engines/test_vllm_families.py",
                          "tests/engines/test_vllm_start_lock.py"], 1),
    # vLLM's sleep pools its memory, which refuses a process whose allocator grew expandable segments
    Group("vllm sleep", [*ONE, "tests/engines/test_vllm_sleep.py"], 1),
    Group("true on-policy 0.6b", [*ONE, "tests/engines/test_vllm_true_on_policy.py", "-k", "not demo"], 1),
    Group("true on-policy demo", [*ONE, "tests/engines/test_vllm_true_on_policy.py", "-k", "demo"], 1),
    Group("system", [*ONE, "tests/test_gpu_system.py", "tests/test_eval_gpu.py"], 1),
]
# Every other one-GPU test: the groups above name their files, this one takes the rest.
NAMED = {a for g in SINGLE for a in g.args if a.startswith("tests/")}
SINGLE.append(Group("other", [*ONE, "tests", *(f"--ignore={p}" for p in sorted(NAMED))], 1))
TWO = ["-m", "two_gpus"]
DOUBLE = [
    Group("fsdp and nccl sync", [*TWO, "tests/test_gpu_system.py", "-k", "not tensor_parallel"], 2),
    Group("copy engine", [*TWO, "tests/weight_sync/test_copy_engine_chunks.py"], 2),
    Group("tensor parallel", [*TWO, "tests/test_gpu_system.py", "-k", "tensor_parallel"], 2),
    Group("nccl faults", [*TWO, "tests/faults/test_nccl_faults.py"], 2),
    Group("expert parallel", [*TWO, "tests/trainer/test_expert_parallel.py"], 2),
]


def run_group(group: Group, devices: str, log: Path | None, timeout_s: float) -> Group:
    """Runs `group` on `devices`; its whole output goes to `log` (appended as soon as the group
    ends, so a caller stopped later keeps it) and its failures to stdout."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": devices, "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    # Stopped at its timeout with every process it started (engines, procs, a test's workers:
    # coreutils timeout signals its whole process group), so it leaves the GPUs to the next group;
    # its output goes through a file, which a process that escaped the stop could not hold open as
    # it could a pipe.
    stopped_at_timeout = ["timeout", "--kill-after", "30", str(timeout_s)]
    with tempfile.TemporaryFile("w+") as output:
        done = subprocess.run([*stopped_at_timeout, sys.executable, *PYTEST, *group.args], cwd=ROOT, env=env,
                              stdout=output, stderr=subprocess.STDOUT)
        output.seek(0)
        group.log = output.read()
    group.seconds = time.monotonic() - start
    # `within` exits 124 once its signal stopped the group, and dies of SIGKILL where it had to kill
    # it 30 s later.
    if done.returncode == 124 or (done.returncode == -signal.SIGKILL and group.seconds >= timeout_s):
        group.returncode = -1
        group.log += f"\ntimed out after {timeout_s:.0f} s"
    else:
        group.returncode = done.returncode
    # pytest's last line counts the tests; output of the processes it started may follow it.
    summaries = [line for line in group.log.splitlines() if re.search(r"\d+ (passed|failed|errors?|deselected)", line)
                 and re.search(r" in [\d.]+s", line)]
    summary = summaries[-1].strip("= ") if summaries else ""
    group.counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected)", summary)}
    group.counts["errors"] = group.counts.pop("error", 0) + group.counts.pop("errors", 0)
    if log is not None:
        with log.open("a") as f:
            f.write(f"\n===== {group.name} (GPU {devices}) =====\n{group.log}")
    problems = [line for line in group.log.splitlines() if line.startswith(("FAILED", "ERROR", "SKIPPED"))]
    print("\n".join([f"[{group.name}] on GPU {devices}: {summary or 'no summary'} ({group.seconds:.0f} s)",
                     *(f"  {line[:400]}" for line in problems)]), flush=True)
    return group


def gpu_names() -> list[str]:
    if shutil.which("nvidia-smi") is None:
        sys.exit('error: nvidia-smi not found: the GPU suite runs on a machine with NVIDIA GPUs '
                 '(docs/gpu.md)')
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


def failed(group: Group, mode: str) -> bool:
    lacking_gpus = mode == "2gpu" and re.search(r"SKIPPED.*needs 2 GPUs", group.log) is not None
    return group.returncode not in (0, 5) or group.counts.get("failed", 0) > 0 or group.counts["errors"] > 0 \
        or lacking_gpus


COLUMNS = ("group", "GPUs", "passed", "failed", "errors", "skipped", "seconds", "result")
STAMP = ("date", "machine", "commit", "command", "mode")


def cells(g: Group, mode: str) -> list[object]:
    c = g.counts
    return [g.name, g.gpus, c.get("passed", 0), c.get("failed", 0), c["errors"], c.get("skipped", 0),
            f"{g.seconds:.0f}", "FAIL" if failed(g, mode) else "ok"]


def row(values: list[object]) -> str:
    return "| " + " | ".join(str(v) for v in values) + " |"


def table(groups: list[Group], mode: str) -> str:
    return "\n".join([row(COLUMNS), "|---" * len(COLUMNS) + "|", *(row(cells(g, mode)) for g in groups)])


def check_results_table() -> None:
    """Stops, before any group runs, unless RESULTS ends in a table headed `STAMP + COLUMNS`."""
    header = row([*STAMP, *COLUMNS])
    if header not in RESULTS.read_text().splitlines():
        raise SystemExit(f"error: {RESULTS} has no table headed {header}")


def append_row(group: Group, mode: str, stamp: list[object]) -> None:
    """The group's row at the end of RESULTS."""
    with RESULTS.open("a") as f:
        f.write(row([*stamp, mode, *cells(group, mode)]) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("1gpu", "2gpu"))
    parser.add_argument("--groups", nargs="+", help="run only these groups (by name; default: every group)")
    parser.add_argument("--timeout", type=float, default=GROUP_TIMEOUT_S, help="seconds a group may take")
    parser.add_argument("--log", type=Path, default=None, help="a file for every group's whole pytest output")
    args = parser.parse_args()
    groups = SINGLE if args.mode == "1gpu" else DOUBLE
    if args.groups:
        unknown = set(args.groups) - {g.name for g in groups}
        if unknown:
            sys.exit(f"error: --groups: no group {sorted(unknown)} in {args.mode}: {[g.name for g in groups]}")
        groups = [g for g in groups if g.name in args.groups]
    names = gpu_names()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(len(names))]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    machine = f"{len(names)} x {names[0]}" if names else "no GPU"
    command = "python scripts/gpu_suite.py " + shlex.join(sys.argv[1:])
    stamp = [datetime.date.today(), machine, commit, f"`{command}`"]
    check_results_table()
    recording = threading.Lock()  # 1gpu groups end in threads of their own

    def run_and_record(group: Group, on: str) -> Group:
        run_group(group, on, args.log, args.timeout)
        with recording:
            append_row(group, args.mode, stamp)
        return group

    start = time.monotonic()
    if args.mode == "1gpu":
        free: queue.Queue[str] = queue.Queue()
        for d in devices:
            free.put(d)

        def on_a_free_gpu(group: Group) -> Group:  # one group per GPU at a time
            device = free.get()
            try:
                return run_and_record(group, device)
            finally:
                free.put(device)

        with ThreadPoolExecutor(max_workers=max(1, len(devices))) as pool:
            list(pool.map(on_a_free_gpu, groups))
    else:
        if len(devices) < 2:
            sys.exit(f"error: 2gpu needs two visible GPUs, found {len(devices)}")
        for g in groups:
            run_and_record(g, ",".join(devices[:2]))
    wall = time.monotonic() - start
    result = table(groups, args.mode)
    print("\n" + result)
    print(f"{wall:.0f} s in all")
    sys.exit(1 if any(failed(g, args.mode) for g in groups) else 0)


if __name__ == "__main__":
    main()
