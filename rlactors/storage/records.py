"""JSONL records that a crash can cut (metrics.jsonl, samples.jsonl), and writes that a full or
failing disk can stop.

A process killed mid-append leaves a torn last line: it is read back as absent (and said so, one
line), never as an error. A storage fault (ENOSPC, EROFS, EIO, EDQUOT) raised at a write carries
the path it hit, so the run can stop on one line naming it (rlactors.run.run_dir.RunDir.storage_error).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EROFS, errno.EIO, errno.EDQUOT})


def is_storage_fault(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno in STORAGE_ERRNOS


@contextlib.contextmanager
def writing(path: str | Path) -> Iterator[None]:
    """Writes to `path` inside; an OSError that names no file (a failed write() or flush) is raised
    again naming `path`."""
    try:
        yield
    except OSError as e:
        if e.filename is None and e.errno is not None:
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise


def read_records(path: str | Path, say: Any = None) -> list[dict[str, Any]]:
    """The JSON object of each line of `path` ([] when it does not exist). A line that is not one
    (a write cut by a crash) is dropped and reported on one line to `say` (default: stderr)."""
    path = Path(path)
    if not path.exists():
        return []
    records, torn = [], []
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
        else:
            torn.append(number)
    if torn:
        lines = ", ".join(map(str, torn[:5])) + (f" and {len(torn) - 5} more" if len(torn) > 5 else "")
        (say or _stderr)(f"{path}: dropped {len(torn)} torn line(s) (line {lines}): a write cut short")
    return records


def keep_records_through(path: str | Path, step: int) -> None:
    """Rewrites `path` with only its records of steps <= `step` (for step 0: the evaluation before
    training), torn lines dropped; atomically, so a crash meanwhile leaves the file as it was."""
    path = Path(path)
    if not path.exists():
        return
    kept = [r for r in read_records(path) if r["step"] <= step]
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with writing(tmp), open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
