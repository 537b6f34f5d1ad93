"""benchmarks/gpu_benchmarks.py: every mode runs scripts and configs that exist; bad options fail
with one line naming the option, before anything starts."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.linux import running

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
                if command[0] == "cp":  # a file of a demo's run dir into the results
                    run_dirs = {Path(a.removeprefix('controller.run_dir="').removesuffix('"'))
                                for _, c in steps for a in c if a.startswith("controller.run_dir=")}
                    assert Path(command[1]).parent in run_dirs
                    assert Path(command[2]).parent == ROOT / "benchmarks" / "results"
                    continue
                if command[0] == "timeout":  # gpu_benchmarks.within: a time limit
                    command = command[4:]
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


def test_a_step_past_its_time_limit_is_stopped_with_what_it_started(tmp_path):
    """A step's processes (vLLM's, Monarch's) must not outlive its limit and hold the GPU."""
    pid_file = tmp_path / "grandchild"
    script = f"sleep 60 & echo $! > {pid_file}; wait"
    done = subprocess.run(gpu_benchmarks.within(1, ["bash", "-c", script]), timeout=50)
    assert done.returncode == 124
    grandchild = int(pid_file.read_text())
    for _ in range(100):  # the signal is sent; the process may take a moment to go
        if not running(grandchild):
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the step's child {grandchild} outlived the limit")


def test_the_agent_mode_trains_from_the_checkpoint_its_warm_start_writes():
    """The warm start writes the policy the run's config names; the run gets a run dir of its own,
    whose metrics the curve reads; every long part has a time limit."""
    import tomllib

    steps = dict(gpu_benchmarks.MODES["agent"].steps(1, False))
    warm_start, run = steps["warm start"], steps["true on-policy run"]
    assert warm_start[0] == run[0] == "timeout" and steps["gateway vs direct, vLLM"][0] == "timeout"
    config = tomllib.loads((ROOT / "configs/agent_tools_1gpu.toml").read_text())
    assert warm_start[warm_start.index("examples/agent_tools/warm_start.py") + 1] == config["model"]["path"]
    assert [a for a in run if a.startswith("model.")] == []
    (run_dir,) = [a.split("=", 1)[1].strip('"') for a in run if a.startswith("controller.run_dir=")]
    assert steps["curve"][2] == run_dir and not run_dir.startswith(config["controller"]["run_dir"])
