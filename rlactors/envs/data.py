"""Records from local data: JSON Lines, Parquet, and directories written by HF `datasets`.

`read_rows(path)` reads every record of a `.jsonl` file, a `.parquet` file, a glob of either
(`data/train-*.parquet`: the files in name order), or a directory saved by
`datasets.Dataset.save_to_disk`, in file order. Each record comes with where it was read: its file
and its row (1-based; in a JSON Lines file, the line number). Bad data raises `DataError` with one
line naming the file, the row and, where one is at fault, the field.

Parquet needs `pyarrow` and HF directories need `datasets`: the `data` extra
(`pip install 'rlactors[data]'`); without them, reading such data fails with a line naming it.
"""

from __future__ import annotations

import glob
import importlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlactors.config import ConfigError

HF_DIR_MARKERS = ("state.json", "dataset_info.json")  # what save_to_disk writes beside the data


class DataError(ConfigError):
    """A data file is missing, unreadable, empty, or a record lacks a usable field."""


@dataclass(frozen=True)
class Row:
    """One record and where it was read: `file` and 1-based `row` (a JSON Lines line number)."""

    file: str
    row: int
    record: dict[str, Any]

    @property
    def where(self) -> str:
        return f"{self.file}: row {self.row}"


def read_rows(path: str) -> list[Row]:
    """Every record of `path` (a file, a glob of files, or an HF `save_to_disk` directory), in order."""
    if any(ch in path for ch in "*?["):
        files = sorted(glob.glob(path))
        if not files:
            raise DataError(f"{path}: no file matches")
        return [row for file in files for row in read_rows(file)]
    p = Path(path)
    if p.is_dir():
        rows = _read_hf_dir(p)
    elif not p.is_file():
        raise DataError(f"{path}: file not found")
    elif p.suffix == ".jsonl":
        rows = _read_jsonl(p)
    elif p.suffix == ".parquet":
        rows = _read_parquet(p)
    else:
        raise DataError(f"{path}: unknown data format (expected a .jsonl or .parquet file, or a directory "
                        "saved by datasets.save_to_disk)")
    if not rows:
        raise DataError(f"{path}: no records (empty {'dataset' if p.is_dir() else 'file'})")
    return rows


def field_value(row: Row, field: str) -> Any:
    """`row.record[field]`; a dotted field (`reward_model.ground_truth`) reads nested records."""
    value: Any = row.record
    for part in field.split("."):
        if not isinstance(value, dict) or part not in value:
            raise DataError(f"{row.where}: field {field!r} is missing (fields: {', '.join(map(str, row.record))})")
        value = value[part]
    return value


def hold_out(items: Sequence[Any], fraction: float, seed: int) -> tuple[list[Any], list[Any]]:
    """(kept, held out): a seeded `fraction` of the items (at least one) held out, each part in
    its original order. The choice depends only on the number of items, `fraction` and `seed`."""
    if not 0 < fraction < 1:
        raise ValueError(f"fraction must be in (0, 1), got {fraction}")
    count = max(1, round(len(items) * fraction))
    if count >= len(items):
        raise ValueError(f"holding out {fraction} of {len(items)} records leaves none")
    order = list(range(len(items)))
    random.Random(f"hold_out:{seed}").shuffle(order)
    held = set(order[:count])
    return ([x for i, x in enumerate(items) if i not in held], [x for i, x in enumerate(items) if i in held])


def _read_jsonl(path: Path) -> list[Row]:
    rows = []
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            where = f"{path}: row {number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line.rstrip("\r\n"))  # so the error's column is on this line
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(record, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
            rows.append(Row(str(path), number, record))
    return rows


def _import_extra(module: str, package: str, what: str, path: Path) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"{path}: reading {what} needs the {package} package: "
                        f"pip install 'rlactors[data]' (or pip install {package})") from None


def _read_parquet(path: Path) -> list[Row]:
    pq = _import_extra("pyarrow.parquet", "pyarrow", "Parquet", path)
    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds for a bad file
        raise DataError(f"{path}: not a readable Parquet file ({_first_line(e)})") from None
    return [Row(str(path), i, record) for i, record in enumerate(table.to_pylist(), start=1)]


def _read_hf_dir(path: Path) -> list[Row]:
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        raise DataError(f"{path}: a DatasetDict of splits {splits}; give one split's directory, "
                        f"e.g. {path / (splits[0] if splits else 'train')}")
    if not any((path / marker).is_file() for marker in HF_DIR_MARKERS):
        raise DataError(f"{path}: a directory, but not one saved by datasets.save_to_disk "
                        f"(no {' or '.join(HF_DIR_MARKERS)})")
    datasets = _import_extra("datasets", "datasets", "a directory saved by datasets", path)
    try:
        dataset = datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - datasets raises several kinds for a bad directory
        raise DataError(f"{path}: datasets.load_from_disk failed ({_first_line(e)})") from None
    return [Row(str(path), i, record) for i, record in enumerate(dataset.to_list(), start=1)]


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
