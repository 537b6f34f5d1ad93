"""benchmarks/colocated_scale.py: every case that `gpu_benchmarks.py scale` and `scale-on-policy`
run builds a valid config whose memory plan fits one H200, with the knobs it needs."""

import argparse
import sys
from pathlib import Path

import pytest

from rlactors.models.tiny import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "benchmarks"))  # as when run from there
import colocated_scale  # noqa: E402
import gpu_benchmarks  # noqa: E402


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    return {size: make_tiny_checkpoint(root / size, size=size, weights=False) for size in ("1.7b", "4b", "8b")}


def case_options(command):
    """The benchmark's options as a gpu_benchmarks step runs it."""
    argv = command[command.index("benchmarks/colocated_scale.py") + 1:]
    parser = argparse.ArgumentParser()
    for flag in ("--size", "--rollout-tokens", "--steps"):
        parser.add_argument(flag)
    for flag in ("--offload", "--true-on-policy"):
        parser.add_argument(flag, action="store_true")
    opts = parser.parse_args(argv)
    return argparse.Namespace(size=opts.size, rollout_tokens=int(opts.rollout_tokens), steps=int(opts.steps or 2),
                              offload=opts.offload, true_on_policy=opts.true_on_policy, row_tokens=16384, prompts=2,
                              group_size=8, gpu_memory_utilization=None, gpu_gib=139.8, dry_run=False)


# size: (the knobs the plan needs, vLLM's share of the GPU)
EXPECTED = {"1.7b": ([], 0.82), "4b": ([], 0.63),
            "8b": (["trainer.offload_optimizer=true", "trainer.activation_checkpointing=true"], 0.74)}


@pytest.mark.parametrize("mode", ["scale", "scale-on-policy"])
def test_every_case_fits_one_h200_with_the_knobs_it_needs(mode, shapes, tmp_path):
    steps = gpu_benchmarks.MODES[mode].steps(1, False)
    assert len(steps) == {"scale": 9, "scale-on-policy": 2}[mode]
    for _, command in steps:
        opts = case_options(command)
        config, knobs, memory = colocated_scale.fitting_config(opts, shapes[opts.size], tmp_path)
        assert memory.problems() == [], (opts.size, opts.rollout_tokens)
        needed, share = EXPECTED[opts.size]
        if opts.true_on_policy and opts.size == "4b":  # eager layers keep more activations
            needed = ["trainer.activation_checkpointing=true"]
        assert knobs == [*needed, f"generator.gpu_memory_utilization={share}"], (opts.size, opts.rollout_tokens)
        assert (config.generator.sleep, config.controller.colocate, config.controller.mode) == (True, True, "sync")
        assert config.rollout.max_tokens_per_turn == opts.rollout_tokens
        assert config.batcher.row_tokens >= config.rollout.max_total_tokens


def test_a_case_needs_a_size_and_a_rollout_length(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["colocated_scale.py", "--size", "4b"])
    with pytest.raises(SystemExit) as exit:
        colocated_scale.main()
    assert exit.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith("--size and --rollout-tokens are needed (or --dry-run)")
