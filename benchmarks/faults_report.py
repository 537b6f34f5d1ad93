"""Runs the fault-injection suite (tests/faults) and writes benchmarks/results/faults.md: each fault,
what was injected, how long detection took and what was lost.

    python benchmarks/faults_report.py                 # one pass of the suite
    python benchmarks/faults_report.py --runs 3        # detection times as min / median / max of 3 passes

Every test of the suite records its measurements through the `fault_record` fixture when
RLACTORS_FAULTS_REPORT names a file; this script sets it, runs pytest, and renders the records.
A failing test fails the report (no table is written from a failing suite).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results_table import commit, machine

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "faults.md"
# Records of the two_gpus fault tests (tests/faults/test_nccl_faults.py), kept from runs on GPU
# machines with their machine, date, commit and command; shown beside the CPU suite's.
GPU_RECORDS = REPO / "benchmarks" / "results" / "faults_gpu.jsonl"
# Sections other tools append at the end (faults_torture.py, trainer_recovery.py): kept as they are.
KEPT_SECTIONS = ("## Kill and resume torture", "## In-job trainer recovery")


def run_suite(records: Path) -> float:
    env = {**os.environ, "RLACTORS_FAULTS_REPORT": str(records)}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "tests/faults", "-q", "-p", "no:cacheprovider"],
                          cwd=REPO, env=env)
    if done.returncode != 0:
        sys.exit(f"tests/faults failed (exit {done.returncode}); no report written")
    return time.monotonic() - start


def seconds(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.2f} s"
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f} s"


def render(rows: list[dict], runs: int, suite_s: list[float], stamp: str) -> str:
    grouped: dict[tuple[str, str, str], list[dict]] = {}
    for row in rows:
        grouped.setdefault((row["test"], row["fault"], row["injected"]), []).append(row)
    timing = "min / median / max over " + f"{runs} passes" if runs > 1 else "one pass"
    lines = [
        "# Fault injection: what breaks, how fast it is seen, what is lost",
        "",
        f"`python benchmarks/faults_report.py --runs {runs}` on {stamp}, "
        f"Python {platform.python_version()}; suite wall time {seconds(suite_s)}. Real Monarch procs on CPU, "
        "tiny random Qwen3, `rlactors.procs.supervision.FAST_SUPERVISION` (Monarch polls every 1 s; its own verdict on "
        "an unanswered state query held back to 10 min) and `rlactors.procs.liveness` (an exit is seen by its pidfd at "
        "once; a silent proc is slow, and lost only after `controller.unresponsive_timeout_s`, 60 s). Times: "
        + timing + ".",
        "",
        "Detection: from the injection to the moment the system knows (the router marks the replica dead; "
        "the controller's watcher logs the trainer's exit; the checksum rejects the weights). Where detection is "
        "synchronous (a raised exception, a NaN check, a timeout at its configured value) it is left blank.",
        "",
        "A whole `make run` (80 steps) on a 3x oversubscribed machine, and detection before and after "
        "`rlactors.procs.liveness`: slow_not_dead.md.",
        "",
        "| fault | injected | detected in | lost | other timings | test |",
        "|---|---|---|---|---|---|",
    ]
    for (test, fault, injected), group in grouped.items():
        detection = [r["detection_s"] for r in group if r["detection_s"] is not None]
        extra_keys = sorted({k for r in group for k in r} - {"test", "fault", "injected", "detection_s", "lost"})
        extras = []
        for key in extra_keys:
            values = [r[key] for r in group if key in r]
            if key.endswith("_s"):
                extras.append(f"{key}: {seconds(values)}")
            else:
                extras.append(f"{key}: " + " / ".join(f"{v:.1f}" for v in sorted(values)))
        lines.append(f"| {fault} | {injected} | {seconds(detection)} | {group[-1]['lost']} | "
                     f"{'; '.join(extras) or '-'} | `{test.split('::')[-1]}` |")
    lines.append("")
    return "\n".join(lines)


def render_gpu(rows: list[dict]) -> str:
    """The GPU fault records, one row each as recorded (benchmarks/results/faults_gpu.jsonl)."""
    lines = ["## On GPUs", "",
             "The `two_gpus` fault tests run on GPU machines only; each row is one recorded run "
             "(RLACTORS_FAULTS_REPORT set), kept in faults_gpu.jsonl.", "",
             "| fault | injected | detected in | lost | other timings | machine, date, commit | test |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        extras = "; ".join(f"{k}: {seconds([r[k]])}" for k in sorted(r) if k.endswith("_s") and k != "detection_s")
        detection = seconds([r["detection_s"]] if r["detection_s"] is not None else [])
        lines.append(f"| {r['fault']} | {r['injected']} | {detection} | {r['lost']} | {extras or '-'} | "
                     f"{r['machine']}, {r['date']}, {r['commit']} | `{r['test'].split('::')[-1]}` |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1, help="passes of the suite (default 1)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    rows, suite_s = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            records = Path(tmp) / f"run{i}.jsonl"
            suite_s.append(run_suite(records))
            rows += [json.loads(line) for line in records.read_text().splitlines()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    gpu = [json.loads(line) for line in GPU_RECORDS.read_text().splitlines()] if GPU_RECORDS.exists() else []
    stamp = f"{machine('cpu')}, {datetime.date.today().isoformat()}, commit {commit()}"
    # Sections other tools append to the file stay as they are: they come from runs of those tools.
    text = args.out.read_text() if args.out.exists() else ""
    starts = [text.index(heading) for heading in KEPT_SECTIONS if heading in text]
    kept = text[min(starts):] if starts else ""
    args.out.write_text(render(rows, args.runs, suite_s, stamp) + ("\n" + render_gpu(gpu) if gpu else "")
                        + ("\n" + kept if kept else ""))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
