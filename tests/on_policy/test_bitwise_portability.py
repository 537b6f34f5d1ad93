"""The bitwise promises hold whatever code path the CPU's math libraries take.

CPU true on-policy runs no BLAS in any op that shapes a logprob: its matmuls and attention are
fixed-order C kernels (``rlactors/on_policy/cpu_kernels.c``), so no setting of the BLAS may change a
bit (tests/on_policy/test_cpu_kernels.py builds those kernels for other instruction sets). Each
setting below runs the bitwise tests in a fresh process (MKL reads its settings once, at its first
call), two processes at a time: MKL's AVX2 and AVX-512 code paths (what differs between CPUs),
its conditional-reproducibility modes, 2 threads instead of 1, and torch's own kernels compiled
for AVX2 instead of this CPU's best. Then a generator and a trainer that run
under different MKL settings and thread counts still agree bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
BITWISE_TESTS = ["on_policy/test_batch_invariant.py", "on_policy/test_invariant_attention.py",
                 "engines/test_true_on_policy.py",
                 "models/test_model.py::test_chunked_token_logprobs_and_entropy_are_the_full_ones"]
SETTINGS = {
    "mkl-avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "mkl-avx512": {"MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "mkl-cbwr-compatible": {"MKL_CBWR": "COMPATIBLE"},
    "mkl-cbwr-avx2": {"MKL_CBWR": "AVX2"},
    "2-threads": {"OMP_NUM_THREADS": "2"},
    "torch-avx2-kernels": {"ATEN_CPU_CAPABILITY": "avx2"},
}
# Settings run at once: each run is one process of one thread (but "2-threads"), and the 2-core CI
# box would leave a core idle while the suite's own process only waits.
PARALLEL = 2


def environment(setting: dict[str, str]) -> dict[str, str]:
    """This process's environment without MKL or ATen settings, one intra-op thread, plus ``setting``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MKL_", "ATEN_CPU"))}
    return {**env, "OMP_NUM_THREADS": "1", **setting}


@pytest.fixture(scope="module")
def bitwise_runs(request):
    """The bitwise tests under each selected setting, each in a fresh process, PARALLEL processes at
    once: name -> a future of its CompletedProcess (killed after 600 s: exit code -9). A process
    still running when the module ends is killed."""
    selected = [item.callspec.params["name"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_bitwise_tests_pass_under"]
    started: list[subprocess.Popen] = []

    def run(name: str) -> subprocess.CompletedProcess:
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *BITWISE_TESTS],
                                cwd=TESTS, env=environment(SETTINGS[name]), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        started.append(proc)
        try:
            out, err = proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    with ThreadPoolExecutor(PARALLEL) as pool:
        runs = {name: pool.submit(run, name) for name in selected}
        try:
            yield runs
        finally:
            for future in runs.values():
                future.cancel()
            for proc in started:
                if proc.poll() is None:
                    proc.kill()


@pytest.mark.parametrize("name", SETTINGS)
def test_bitwise_tests_pass_under(name, bitwise_runs):
    done = bitwise_runs[name].result()
    assert done.returncode == 0, f"{name}:\n{done.stdout[-3000:]}{done.stderr[-2000:]}"
    assert " passed" in done.stdout and "failed" not in done.stdout


GENERATE = """
import sys, torch
from support.true_on_policy import generate, prompts, requests_with
from rlactors.types import SamplingParams
mine = (prompts(1, seed=7)[0], SamplingParams(max_tokens=30, temperature=1.0, seed=3))
torch.save(generate(sys.argv[1], True, requests_with(mine, 16, seed=8), max_num_tokens=96), sys.argv[2])
"""

SCORE = """
import sys, torch
from support.trainer_inputs import one_rank_process_group
from support.true_on_policy import episode, make_core, trainer_and_generator_logprobs
completions = torch.load(sys.argv[2], weights_only=False)
with one_rank_process_group("cpu") as device:
    core = make_core(sys.argv[1], device, true_on_policy=True)
    trainer, generator = trainer_and_generator_logprobs(core, [episode(c) for c in completions.values()], 200)
assert trainer.numel() == sum(len(c.token_ids) for c in completions.values())
print("equal" if torch.equal(trainer, generator) else f"differ by {(trainer - generator).abs().max()}")
"""


def test_generator_and_trainer_under_different_blas_settings_agree_bit_for_bit(tiny_ckpt, tmp_path):
    completions = tmp_path / "completions.pt"
    generator_env = environment({"MKL_ENABLE_INSTRUCTIONS": "AVX2"})
    trainer_env = environment({"MKL_CBWR": "COMPATIBLE", "OMP_NUM_THREADS": "2"})
    subprocess.run([sys.executable, "-c", GENERATE, str(tiny_ckpt), str(completions)], cwd=TESTS,
                   env=generator_env, check=True, timeout=300)
    scored = subprocess.run([sys.executable, "-c", SCORE, str(tiny_ckpt), str(completions)], cwd=TESTS,
                            env=trainer_env, capture_output=True, text=True, timeout=300)
    assert scored.returncode == 0, scored.stderr[-3000:]
    assert scored.stdout.strip().splitlines()[-1] == "equal"
