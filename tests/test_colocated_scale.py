"""benchmarks/colocated_scale.py: every case that `gpu_benchmarks.py scale` and `scale-on-policy`
run builds a valid config whose memory plan fits one H200, with the knobs it needs."""

import math
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


# the knobs the plan needs with 14 GiB to spare, by size; 4B's rows of one 8k rollout need none.
# The weights go by the shared buffer (one replica on the trainer's GPU), which rank 0 keeps
# beside its state
CHECKPOINTING, OFFLOAD = "trainer.activation_checkpointing=true", "trainer.offload_optimizer=true"
EXPECTED = {"1.7b": [], "4b": [CHECKPOINTING], "4b:8192": [], "8b": [OFFLOAD, CHECKPOINTING]}
# vLLM's share, by hand: its bf16 weights, 2 GiB of runtime and a KV cache (K and V of 36 layers
# (1.7B: 28) x 8 heads x 128 in bf16 a token) for a step's rollouts at once, up to 64 of them
# (less than the largest share the plan leaves with 4 GiB to spare, in every cell)
SHARES = {"1.7b:2048": 0.13, "4b:2048": 0.19, "4b:2048:5:onpolicy": 0.11, "8b:2048:5:onpolicy": 0.16,
          "1.7b:8192": 0.09, "4b:8192": 0.14, "8b:2048": 0.24, "8b:8192": 0.19, "1.7b:16384": 0.14,
          "4b:16384": 0.2, "8b:16384": 0.26}


@pytest.mark.parametrize("mode", ["scale", "scale-on-policy"])
def test_every_cell_fits_one_h200_with_the_knobs_it_needs(mode, shapes, tmp_path):
    (_, command), = gpu_benchmarks.MODES[mode].steps(1, False)
    budget = {"scale": gpu_benchmarks.SCALE_BUDGET_S, "scale-on-policy": gpu_benchmarks.ON_POLICY_BUDGET_S}[mode]
    assert command[:4] == ["timeout", "--kill-after", "30", str(budget + 60)]
    assert command[5] == "benchmarks/colocated_scale.py"
    start, end = command.index("--cells") + 1, command.index("--budget-s")
    cells, shared = command[start:end], command[6:start - 1]  # the options every cell runs with
    assert len(cells) == {"scale": 9, "scale-on-policy": 2}[mode]
    assert shared == {"scale": [], "scale-on-policy": ["--prompts", "2"]}[mode]
    for cell in cells:
        opts = colocated_scale.parser().parse_args(colocated_scale.parse_cell(cell) + shared)
        config, knobs, memory = colocated_scale.fitting_config(opts, shapes[opts.size], tmp_path)
        assert memory.problems() == [], cell
        gib, rollouts = 2**30, config.rollout.prompts_per_step * config.rollout.group_size
        kv_token = 2 * (28 if opts.size == "1.7b" else 36) * 8 * 128 * 2
        share = (memory.generator.weights + 2 * gib + min(64, rollouts) * (opts.rollout_tokens + 16) * kv_token)
        assert SHARES[cell] == math.ceil(100 * share / (139.8 * gib)) / 100, cell
        share_knob = f"generator.gpu_memory_utilization={SHARES[cell]}"
        assert knobs == [*EXPECTED.get(cell, EXPECTED[opts.size]), share_knob], cell
        assert (config.generator.sleep, config.controller.colocate, config.controller.mode) == (True, True, "sync")
        assert config.generator.weight_sync == "shared"
        assert config.rollout.max_tokens_per_turn == opts.rollout_tokens
        # whole rollouts of 16 + TOKENS a row, within 16384 tokens (a 16k rollout alone): the plan's
        # microbatch is the one that runs
        assert config.batcher.row_tokens == {2048: 7 * 2064, 8192: 8208, 16384: 16400}[opts.rollout_tokens], cell
        # about 131k tokens a step (8 x 16384), at least one group; 16 rollouts in the on-policy runs
        rollouts = config.rollout.prompts_per_step * config.rollout.group_size
        assert rollouts == 8 * (opts.prompts or max(1, 131072 // (8 * (opts.rollout_tokens + 16)))), cell
        assert opts.steps == (5 if opts.true_on_policy else 2)


def test_cells_parse_and_a_bad_one_fails_naming_the_form():
    assert colocated_scale.parse_cell("8b:2048:5:onpolicy") == [
        "--size", "8b", "--rollout-tokens", "2048", "--steps", "5", "--true-on-policy"]
    assert colocated_scale.parse_cell("1.7b:16384") == ["--size", "1.7b", "--rollout-tokens", "16384"]
    with pytest.raises(ValueError, match=r"^--cells: '4b:2k' is not SIZE:TOKENS\[:STEPS\]\[:onpolicy\]$"):
        colocated_scale.parse_cell("4b:2k")


def test_cells_past_the_budget_do_not_start(tmp_path, capsys):
    opts = colocated_scale.parser().parse_args(["--cells", "tiny:48", "tiny:96", "--budget-s", "30", "--dry-run",
                                                "--out", str(tmp_path / "rows.md")])
    assert colocated_scale.run_cells(opts, colocated_scale.shared_options(opts)) == 0
    assert capsys.readouterr().out.splitlines()[-2:] == ["| tiny:48 | not started: out of --budget-s | 0 |",
                                                         "| tiny:96 | not started: out of --budget-s | 0 |"]
    assert not (tmp_path / "rows.md").exists()
    # what a started cell's process would be given
    child = colocated_scale.parser().parse_args([*colocated_scale.parse_cell("tiny:48"),
                                                 *colocated_scale.shared_options(opts)])
    assert (child.size, child.rollout_tokens, child.dry_run, child.out, child.cells) == (
        "tiny", 48, True, tmp_path / "rows.md", None)


def test_a_case_needs_a_size_and_a_rollout_length(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["colocated_scale.py", "--size", "4b"])
    with pytest.raises(SystemExit) as exit:
        colocated_scale.main()
    assert exit.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        "--size and --rollout-tokens are needed (or --dry-run, or --cells)")
