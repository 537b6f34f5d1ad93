"""SIGKILLs a whole CPU training run at random instants, resumes it each time, and checks that in
the end every step is recorded exactly once (metrics.jsonl, samples.jsonl) and the final
checkpoint verifies against its manifest. Appends a dated, commit-stamped row to
benchmarks/results/faults.md.

    python benchmarks/faults_torture.py --kills 20 --seed 0

The run is the CPU alphabet_sort demo made tiny (few prompts, short turns, a checkpoint every 2
steps). Each kill takes the whole process tree (the CLI is a session leader: every proc in its
session is SIGKILLed); each restart is `--resume` naming only the run dir and model.path. Kill
instants are drawn (seeded): a quarter while the run starts again (or in its first step), the others
at a uniform instant within the step after the first or second step it records (the step time is
measured by the first segment), so they land in every phase: rollouts, the update, the checkpoint
save, the records.
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from faults_report import TORTURE_HEADING as HEADING
from results_table import command, commit, machine

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rlactors.storage.manifest import verify  # noqa: E402
from rlactors.storage.records import read_records  # noqa: E402
from rlactors.trainer.checkpoint import complete_checkpoints  # noqa: E402

RUN_PY = REPO / "examples" / "alphabet_sort" / "run.py"
RESULTS = REPO / "benchmarks" / "results" / "faults.md"

STARTUP_SHARE = 0.25  # of the kills after the first, drawn while the run starts again
TINY = ["controller.checkpoint_every=2", "controller.eval_every=0", "rollout.prompts_per_step=4",
        "rollout.group_size=2", "rollout.max_tokens_per_turn=24", "generator.replicas=1"]


def session_pids(sid: int) -> list[int]:
    """The processes of session `sid` (Linux /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                pids.append(int(entry.name))
    return pids


def kill_session(proc: subprocess.Popen) -> int:
    """SIGKILLs every process of the run's session; waits until none is left. How many were killed."""
    pids = session_pids(proc.pid)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    deadline = time.monotonic() + 60
    while session_pids(proc.pid):
        if time.monotonic() > deadline:
            raise SystemExit(f"processes of the killed run still alive: {session_pids(proc.pid)}")
        time.sleep(0.1)
    return len(pids)


def wait_until(proc: subprocess.Popen, deadline: float) -> None:
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)


def wait_for_records(proc: subprocess.Popen, run_dir: Path, before: int, count: int) -> list[float]:
    """Waits until the run holds `count` step records more than `before`; when each came."""
    seen: list[float] = []
    while len(seen) < count and proc.poll() is None:
        if len(step_records(run_dir)) - before > len(seen):
            seen.append(time.monotonic())
        time.sleep(0.02)
    return seen


def step_records(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_records(run_dir / "metrics.jsonl", say=lambda _: None)
            if "rollout/reward_mean" in r]


def phase(run_dir: Path) -> str:
    """Where the run stood when it was killed, from what it left on disk."""
    recorded = max(step_records(run_dir), default=0)
    saved = max((s for s, _ in complete_checkpoints(run_dir / "checkpoints")), default=0)
    if any((run_dir / "checkpoints").glob(".step_*.partial")):
        return "during a save"
    if saved > recorded:
        return "after a commit, before its records"
    return "elsewhere (startup, rollouts, update)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=0, help="the run's steps (default: 2 per kill, plus 4)")
    parser.add_argument("--run-dir", type=Path, default=None, help="default: a temporary dir, removed")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    steps = args.steps or 2 * args.kills + 4
    code_commit = commit()  # the code every segment runs: taken before the first starts
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = args.run_dir or Path(tmp) / "run"
        overrides = [f'model.path="{REPO / "examples/alphabet_sort/warm_checkpoint"}"',
                     f'controller.run_dir="{run_dir}"', f"controller.steps={steps}", *TINY]
        start = time.monotonic()
        phases, startup_s, step_s = [], 0.0, None
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for attempt in range(args.kills + 1):
            resume = ["--resume"] if attempt else []
            argv = [sys.executable, str(RUN_PY), *resume, *(overrides if not attempt else overrides[:2])]
            launched = time.monotonic()
            log = open(Path(tmp) / f"segment{attempt}.log", "w")
            proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            before = len(step_records(run_dir))
            if attempt == args.kills:  # the last segment runs to the end
                code = proc.wait()
                log.close()
                if code != 0:
                    raise SystemExit(f"the final resume failed (exit {code}): {log.name}")
                break
            if step_s is None:  # calibrate: the first segment runs 3 steps, then is killed in the 4th
                seen = wait_for_records(proc, run_dir, before, 3)
                startup_s, step_s = seen[0] - launched, max(0.5, (seen[-1] - seen[0]) / 2)
                wait_until(proc, time.monotonic() + rng.uniform(0, step_s))
            elif rng.random() < STARTUP_SHARE:  # while it starts again, or in its first step
                wait_until(proc, launched + rng.uniform(0, startup_s))
            else:  # in the step after the 1st or 2nd it records: its rollouts, update, save or records
                wait_for_records(proc, run_dir, before, rng.choice((1, 2)))
                wait_until(proc, time.monotonic() + rng.uniform(0, 1.2 * step_s))
            if proc.poll() is not None:
                raise SystemExit(f"segment {attempt} ended by itself (exit {proc.returncode}) before its kill: "
                                 f"raise --steps; {log.name}")
            kill_session(proc)
            log.close()
            phases.append(phase(run_dir))
            print(f"kill {attempt + 1}/{args.kills} at {time.monotonic() - launched:.1f} s: {phases[-1]}; "
                  f"{len(step_records(run_dir)) - before:+d} step records", flush=True)
        wall_s = time.monotonic() - start

        recorded = step_records(run_dir)
        samples = read_records(run_dir / "samples.jsonl")
        sample_keys = [(r["step"], r["group"], r["rollout"]) for r in samples]
        final = max(complete_checkpoints(run_dir / "checkpoints"))
        problems = []
        if recorded != list(range(1, steps + 1)):
            problems.append(f"metrics.jsonl steps {recorded}")
        if sorted({s for s, _, _ in sample_keys}) != list(range(1, steps + 1)) or \
                len(set(sample_keys)) != len(sample_keys):
            problems.append("samples.jsonl: a step missing or recorded twice")
        if final[0] != steps or (damage := verify(final[1])) is not None:
            problems.append(f"final checkpoint {final[1]}: {'step ' + str(final[0]) if final[0] != steps else damage}")
    counts = {p: phases.count(p) for p in dict.fromkeys(sorted(phases))}
    outcome = "; ".join(problems) if problems else (
        f"every step recorded once ({steps} in metrics.jsonl, {len(sample_keys)} samples), final checkpoint "
        "verifies, no proc left")
    row = (f"| {datetime.date.today().isoformat()} | {code_commit} | {machine('cpu')} | `{command()}` | {args.kills} | "
           f"{steps} | {', '.join(f'{p}: {n}' for p, n in counts.items())} | {wall_s:.0f} s | {outcome} |")
    print(row)
    write_row(args.out, row)
    return 1 if problems else 0


def write_row(out: Path, row: str) -> None:
    """Appends `row` to the torture section at the end of `out` (made on the first run)."""
    text = out.read_text() if out.exists() else ""
    if HEADING not in text:
        text = text.rstrip("\n") + "\n\n" + "\n".join([
            HEADING, "",
            "`benchmarks/faults_torture.py`: a tiny CPU alphabet_sort run SIGKILLed whole (every process of its "
            "session) at seeded random instants (a quarter while it starts again, the others inside the step after "
            "its first or second new record), resumed with `--resume` after each kill; then checked: each step "
            "recorded once in metrics.jsonl and samples.jsonl, the final checkpoint verified against its manifest.",
            "", "| date | commit | machine | command | kills | steps | where the kills landed | wall time | outcome |",
            "|---|---|---|---|---|---|---|---|---|"]) + "\n"
    out.write_text(text.rstrip("\n") + "\n" + row + "\n")


if __name__ == "__main__":
    sys.exit(main())
