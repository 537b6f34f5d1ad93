"""benchmarks/weight_sync_data_path.py on CPU (gloo): the sender packs and sends, the receiver
verifies every sync, each chunk size in a group of its own, and --profile writes each side's
trace; bad options fail before anything starts. (On GPUs its chunks go by copy engine; that
run is the device machine's.)"""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "benchmarks"))  # as when run from there
import weight_sync_data_path  # noqa: E402


def test_every_sync_is_verified_at_every_chunk_size_and_each_side_leaves_a_trace(tmp_path):
    options = {"device": "cpu", "size": "tiny", "chunk_mib": [1, 2], "iters": 2, "profile": str(tmp_path),
               "gpus": []}
    results = weight_sync_data_path.measure(options)  # the sender raises unless every sync was verified
    assert sorted(results) == [1, 2]
    for timings in results.values():
        assert len(timings["send_s"]) == len(timings["send_device_s"]) == len(timings["pack_s"]) == 2
        assert len(timings["receive_verify_s"]) == 2
        assert timings["copy_engine"] is False  # gloo broadcasts
        assert all(0 < pack <= span <= send for pack, span, send in
                   zip(timings["pack_s"], timings["send_device_s"], timings["send_s"]))
    traces = sorted(p.name for p in tmp_path.iterdir())
    assert len(traces) == 4 and {t.split("_")[0] for t in traces} == {"send", "receive"}, traces
    assert all(json.loads((tmp_path / t).read_text())["traceEvents"] for t in traces)


@pytest.mark.parametrize("argv, error", [
    (["--iters", "0"], "error: --iters: at least 1, got 0"),
    (["--chunk-mib", "256", "0"], "error: --chunk-mib: each at least 1, got [256, 0]"),
])
def test_bad_options_fail_with_one_line_before_anything_starts(monkeypatch, capsys, argv, error):
    monkeypatch.setattr(sys, "argv", ["weight_sync_data_path.py", "--device", "cpu", *argv])
    monkeypatch.setattr(weight_sync_data_path, "measure", lambda options: pytest.fail("it started"))
    with pytest.raises(SystemExit) as exited:
        weight_sync_data_path.main()
    assert exited.value.code == 2 and capsys.readouterr().err.strip().endswith(error)
