"""benchmarks/learning_curve.py: a run's curve is one row under its table; the mismatch figures count
only the steps whose tokens the metrics cover."""

import datetime
import json
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
    assert learning_curve.mismatch([step(100, 0.0, 100), step(0, 0.0, 0), step(300, 0.5, 300, 0.1)]) == (
        "max 0.5 over 2 of 3 steps (400 tokens), above 0 at 1", "0.075 of 400 tokens over 2 steps, max 0.1")


def test_experts_never_returned_are_reported_as_not_measured_and_a_dense_model_gets_no_expert_figure():
    assert learning_curve.mismatch([step(50, 0.0, 0), step(0, 0.0, 0)])[1] == (
        "not measured (no experts from the generator)")
    assert learning_curve.mismatch([step(50, 0.0)])[1] == "-"
    assert learning_curve.mismatch([step(0, 0.0)]) == ("-", "-")


def test_a_learning_curve_is_one_row_under_its_table_with_every_eval_and_window(tmp_path, monkeypatch):
    run_dir = tmp_path / "demo_run"
    run_dir.mkdir()
    steps = [{"step": s, "rollout/reward_mean": r, "time/step_s": t, "loss/current_policy_tokens": 10.0,
              "loss/logprob_diff/max": d}
             for s, r, t, d in [(1, 0.25, 1.0, 0.0), (2, 0.5, 3.0, 0.125), (3, 1.0, 2.0, 0.0)]]
    evals = [{"step": s, "eval/reward_mean": r, "eval/pass@1": p, "eval/samples": 8.0}
             for s, r, p in [(0, 0.125, 0.0), (3, 0.625, 0.5)]]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [evals[0], *steps, evals[1]]))
    out = tmp_path / "demo_learning.md"
    out.write_text("# Demo\n\nWhat it measures.\n\n" + "| date | machine | commit | command | "
                   + " | ".join(learning_curve.COLUMNS) + " |\n|" + "---|" * 10 + "\n| an earlier row |\n\nA note.\n")
    figures = learning_curve.learning_curve(run_dir, window=2)
    assert figures == ["demo_run", "0: 0.125 (0.000), 3: 0.625 (0.500); 8 samples", "1-2: 0.375, 3-3: 1.000", "2.00",
                       "max 0.125 over 3 of 3 steps (30 tokens), above 0 at 1", "-"]
    monkeypatch.setattr(sys, "argv", ["learning_curve.py", str(run_dir), "--command", "python demo.py",
                                      "--machine", "GPU x1", "--window", "2", "--out", str(out)])
    learning_curve.main()
    lines = out.read_text().splitlines()
    assert lines[-4] == "| an earlier row |" and lines[-2:] == ["", "A note."]
    date, machine, _, command, *rest = (c.strip() for c in lines[-3].strip("|").split(" | "))
    assert (date, machine, command, rest) == (datetime.date.today().isoformat(), "GPU x1", "`python demo.py`", figures)
