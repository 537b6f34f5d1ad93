"""benchmarks/gpu_benchmarks.py: every mode runs scripts and configs that exist; bad options fail
with one line naming the option, before anything starts."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "benchmarks"))  # as when run from there
import gpu_benchmarks  # noqa: E402


@pytest.mark.parametrize("name", sorted(gpu_benchmarks.MODES))
def test_every_mode_runs_scripts_and_configs_of_the_repository(name):
    mode = gpu_benchmarks.MODES[name]
    for gpus in mode.gpus:
        for true_on_policy in (False, True) if name == "learning-curve" else (False,):
            steps = mode.steps(gpus, true_on_policy)
            assert steps
            for _, command in steps:
                if command[0] == "cp":  # learning-curve: a file of the demo's run dir into the results
                    run_dir = steps[0][1][-1].removeprefix('controller.run_dir="').removesuffix('"')
                    assert Path(command[1]).parent == Path(run_dir)
                    assert Path(command[2]).parent == ROOT / "benchmarks" / "results"
                    continue
                named = [a for a in command if a.endswith((".py", ".toml")) and " " not in a]
                assert command[0] == "python" and named, command
                for path in named:
                    assert (ROOT / path).is_file(), f"{name} on {gpus} GPU(s): {path}"


@pytest.mark.parametrize("args, error", [
    (["weight-sync", "--gpus", "3"], "error: --gpus: weight-sync runs on 2 or 4 GPU(s), not 3"),
    (["generation", "--gpus", "2"], "error: --gpus: generation runs on 1 GPU(s), not 2"),
    (["training", "--true-on-policy"], "error: --true-on-policy: only learning-curve takes it, not training"),
])
def test_bad_options_fail_with_one_line_and_exit_2(args, error):
    done = subprocess.run([sys.executable, "benchmarks/gpu_benchmarks.py", *args], cwd=ROOT, capture_output=True,
                          text=True)
    assert (done.returncode, done.stderr, done.stdout) == (2, error + "\n", "")
