"""rlactors.envs.data: JSON Lines, Parquet and HF datasets directories, and one-line errors for bad data."""

import json
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlactors.envs.data import DataError, Row, field_value, hold_out, read_rows

RECORDS = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(5)]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def write_parquet(path, records):
    pq.write_table(pa.Table.from_pylist(records), path)
    return str(path)


def test_jsonl_rows_keep_file_order_and_line_numbers(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(RECORDS[0]) + "\n\n" + json.dumps(RECORDS[1]) + "\n")  # a blank line is skipped
    rows = read_rows(str(path))
    assert [(r.row, r.record) for r in rows] == [(1, RECORDS[0]), (3, RECORDS[1])]
    assert rows[1].where == f"{path}: row 3"


def test_parquet_and_a_glob_of_shards(tmp_path):
    write_parquet(tmp_path / "train-00000-of-00002.parquet", RECORDS[:3])
    write_parquet(tmp_path / "train-00001-of-00002.parquet", RECORDS[3:])
    one = read_rows(str(tmp_path / "train-00001-of-00002.parquet"))
    assert [(r.row, r.record) for r in one] == [(1, RECORDS[3]), (2, RECORDS[4])]
    both = read_rows(str(tmp_path / "train-*.parquet"))
    assert [r.record for r in both] == RECORDS
    assert both[3].where == f"{tmp_path / 'train-00001-of-00002.parquet'}: row 1"
    pq.write_table(pa.table({"question": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    with pytest.raises(DataError, match=r"empty.parquet: no records \(empty file\)$"):
        read_rows(str(tmp_path / "empty.parquet"))


def test_hf_datasets_directory(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(RECORDS).save_to_disk(str(tmp_path / "ds"))
    rows = read_rows(str(tmp_path / "ds"))
    assert [r.record for r in rows] == RECORDS and rows[0].where == f"{tmp_path / 'ds'}: row 1"

    datasets.DatasetDict({"train": datasets.Dataset.from_list(RECORDS)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"dd: a DatasetDict of splits \['train'\]; give one split's directory, "
                                        r"e.g. .*dd/train$"):
        read_rows(str(tmp_path / "dd"))
    (tmp_path / "ds" / "data-00000-of-00001.arrow").write_bytes(b"not arrow")
    with pytest.raises(DataError, match=r"ds: datasets.load_from_disk failed \(.+\)$"):
        read_rows(str(tmp_path / "ds"))


def test_nested_fields_are_read_by_dotted_names():
    row = Row("f.parquet", 4, {"reward_model": {"ground_truth": "7"}, "prompt": "p"})
    assert field_value(row, "reward_model.ground_truth") == "7"
    with pytest.raises(DataError, match=r"^f.parquet: row 4: field 'reward_model.answer' is missing "
                                        r"\(fields: reward_model, prompt\)$"):
        field_value(row, "reward_model.answer")
    with pytest.raises(DataError, match=r"field 'prompt.text' is missing"):
        field_value(row, "prompt.text")


@pytest.mark.parametrize("content, message", [
    (b"", r"no records \(empty file\)"),
    (b"\n  \n", r"no records \(empty file\)"),
    (b'{"question": "a"}\n{"question": "b",\n', r"row 2: not valid JSON \(Expecting property name enclosed in "
                                                 r"double quotes at column \d+\)"),
    (b'{"question": "a"}\n\n["a list"]\n', r"row 3: expected a JSON object, got list"),
    (b'{"question": "a"}\n{"question": "\xff"}\n', r"row 2: not UTF-8 text \(invalid start byte at byte 14\)"),
])
def test_bad_jsonl_names_the_file_and_row(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError, match=f"^{path}: {message}$"):
        read_rows(str(path))


def test_bad_paths_and_formats_are_named(tmp_path):
    with pytest.raises(DataError, match=f"^{tmp_path}/missing.jsonl: file not found$"):
        read_rows(str(tmp_path / "missing.jsonl"))
    with pytest.raises(DataError, match=r"nothing-\*.parquet: no file matches$"):
        read_rows(str(tmp_path / "nothing-*.parquet"))
    (tmp_path / "data.csv").write_text("question,answer\n")
    with pytest.raises(DataError, match=r"data.csv: unknown data format \(expected a .jsonl or .parquet file"):
        read_rows(str(tmp_path / "data.csv"))
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(DataError, match=r"broken.parquet: not a readable Parquet file \(.+\)$"):
        read_rows(str(tmp_path / "broken.parquet"))
    (tmp_path / "plain_dir").mkdir()
    with pytest.raises(DataError, match=r"plain_dir: a directory, but not one saved by datasets.save_to_disk"):
        read_rows(str(tmp_path / "plain_dir"))


def test_a_missing_optional_package_names_the_extra(tmp_path, monkeypatch):
    parquet = write_parquet(tmp_path / "train.parquet", RECORDS)
    hf_dir = tmp_path / "ds"
    hf_dir.mkdir()
    (hf_dir / "state.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import fails as if not installed
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DataError, match=r"train.parquet: reading Parquet needs the pyarrow package: "
                                        r"pip install 'rlactors\[data\]' \(or pip install pyarrow\)$"):
        read_rows(parquet)
    with pytest.raises(DataError, match=r"ds: reading a directory saved by datasets needs the datasets package: "
                                        r"pip install 'rlactors\[data\]'"):
        read_rows(str(hf_dir))


def test_hold_out_is_seeded_keeps_order_and_leaves_a_train_part():
    items = list(range(100))
    kept, held = hold_out(items, 0.1, seed=3)
    assert len(held) == 10 and sorted(kept + held) == items
    assert kept == sorted(kept) and held == sorted(held)
    assert (kept, held) == hold_out(items, 0.1, seed=3)
    assert held != hold_out(items, 0.1, seed=4)[1]
    assert len(hold_out(items[:5], 0.01, seed=0)[1]) == 1  # at least one
    with pytest.raises(ValueError, match="leaves none"):
        hold_out(items[:1], 0.5, seed=0)
