"""benchmarks/learning_curve.py: the mismatch lines count only the steps whose tokens the metrics cover."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "benchmarks"))  # as when run from there
import learning_curve  # noqa: E402


def step(current: float, diff: float, routed: float | None = None, mismatch: float = 0.0) -> dict:
    record = {"loss/current_policy_tokens": current, "loss/logprob_diff/max": diff}
    if routed is not None:
        record.update({"loss/routed_tokens": routed, "loss/expert_mismatch/share": mismatch})
    return record


def test_an_async_runs_steps_without_current_policy_tokens_are_not_counted_as_measured():
    lines = learning_curve.mismatch_lines([step(100, 0.0, 100), step(0, 0.0, 0), step(300, 0.5, 300, 0.1)])
    assert lines == [
        "`loss/logprob_diff/max`: max 0.5 over the 2 of 3 steps with tokens of the trainer's current policy "
        "(400 tokens), above 0 at 1.",
        "`loss/expert_mismatch/share`: 0.075 of 400 tokens over 2 steps; max 0.1 in a step.", ""]


def test_experts_never_returned_are_reported_as_not_measured_and_a_dense_model_gets_no_expert_line():
    assert learning_curve.mismatch_lines([step(50, 0.0, 0), step(0, 0.0, 0)])[1].startswith(
        "`loss/expert_mismatch/share`: not measured")
    assert len(learning_curve.mismatch_lines([step(50, 0.0)])) == 2
    assert learning_curve.mismatch_lines([step(0, 0.0)]) == []
