"""benchmarks/lora_weight_sync.py on CPU (gloo): each row's sync goes by weight sync's own data path
and is verified; the adapters' bytes are r * (in + out) per adapted linear, so they grow with the
rank; the native engine's merge is timed. (On a GPU the chunks go by copy engine and the device
copy is a GPU copy: the device machine's run.)"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "benchmarks"))  # as when run from there
import lora_weight_sync  # noqa: E402

from rlactors.models.tiny import TOKENIZER_VOCAB_SIZE, size_args  # noqa: E402


def test_the_adapters_bytes_are_proportional_to_the_rank():
    args = size_args("1.7b", TOKENIZER_VOCAB_SIZE)
    h, i, layers = args.hidden_size, args.intermediate_size, args.num_hidden_layers
    q, kv = args.num_attention_heads * args.head_dim, args.num_key_value_heads * args.head_dim
    per_rank = layers * ((h + q) * 2 + (h + kv) * 2 + (h + i) * 3)  # q, o; k, v; gate, up, down
    for rank in (16, 64):
        shapes = lora_weight_sync.synced_shapes("1.7b", rank)
        assert len(shapes) == 2 * 7 * layers
        assert sum(s.numel() for s in shapes.values()) == rank * per_rank
    full = sum(s.numel() for s in lora_weight_sync.synced_shapes("1.7b", 0).values())
    assert 1.7e9 < full < 2.1e9


def test_the_adapters_go_by_the_data_path_verified():
    shapes = lora_weight_sync.synced_shapes("tiny", 8)
    options = {"device": "cpu", "size": "tiny", "chunk_mib": [1], "iters": 1, "profile": None, "gpus": [],
               "shapes": shapes}
    timings = lora_weight_sync.measure(options)[1]  # the sender raises unless every sync was verified
    assert len(timings["send_s"]) == len(timings["receive_verify_s"]) == 1


def test_a_run_writes_a_row_per_rank_beside_the_device_copy_and_the_merge(monkeypatch):
    """main's rows, the data path stubbed (the test above runs it): full weights first, then each rank."""
    rows = []
    monkeypatch.setattr(lora_weight_sync, "append_row", lambda path, title, columns, row, device: rows.append(row))
    monkeypatch.setattr(lora_weight_sync, "measure", lambda options: {
        options["chunk_mib"][0]: {"send_s": [0.002, 0.003, 0.004], "receive_verify_s": [0.001] * 3}})
    monkeypatch.setattr(sys, "argv", ["lora_weight_sync.py", "--device", "cpu", "--sizes", "tiny", "--ranks", "8", "16",
                                      "--iters", "1"])
    lora_weight_sync.main()
    assert [r[:2] for r in rows] == [["tiny", "full weights"], ["tiny", "8"], ["tiny", "16"]]
    megabytes = [float(r[2]) for r in rows]
    assert megabytes[1] < megabytes[0] / 5 and abs(megabytes[2] - 2 * megabytes[1]) < 0.015  # to the 0.01 MB printed
    assert [r[4] for r in rows] == ["3.00 (2.00-4.00)"] * 3  # send ms, median (min-max)
    assert all(float(r[6]) > 0 for r in rows)  # the device copy, timed in this run
    merge = lora_weight_sync.COLUMNS.index("merge ms")
    assert rows[0][merge] == "n/a" and all(float(r[merge]) > 0 for r in rows[1:])  # the merge, with LoRA only
    assert all(float(r[-2]) > 0 for r in rows)  # by messages, a one-GPU run's path
