"""MANIFEST.json: the size and sha256 of each file of a directory (a trainer checkpoint, its HF
export), written after them, so that a load can tell a damaged or missing file before it reads one.

sha256 streamed in 8 MiB blocks, files hashed in parallel threads (hashlib releases the GIL): at
disk speed or near it on current CPUs. The manifest carries a checksum of its own entries, so a
damaged manifest is named as such.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rlactors.storage.records import writing

MANIFEST_FILE = "MANIFEST.json"
_HASH = "sha256"
_BLOCK = 8 << 20


def checksum(path: Path) -> str:
    """sha256 of the file, read in large blocks."""
    h = hashlib.new(_HASH)
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


def _listed_files(directory: Path, later: tuple[str, ...]) -> list[str]:
    """The files under `directory` but the manifest and the `later` ones (written after it)."""
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")
                  if p.is_file() and p.relative_to(directory).as_posix() not in (MANIFEST_FILE, *later))


def _checksums(directory: Path, names: list[str]) -> list[str]:
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(names)))) as pool:  # hashlib releases the GIL
        return list(pool.map(lambda name: checksum(directory / name), names))


def _digest_of(files: dict[str, Any]) -> str:
    """The manifest's own checksum: a damaged manifest is told apart from damaged files."""
    return hashlib.new(_HASH, json.dumps(files, sort_keys=True).encode()).hexdigest()


def write_manifest(directory: Path, later: tuple[str, ...] = ()) -> None:
    """MANIFEST.json: size and sha256 of every file under `directory` (but the `later` ones, which
    go in after it); written (atomically) after them."""
    names = _listed_files(directory, later)
    files = {name: {"bytes": (directory / name).stat().st_size, _HASH: digest}
             for name, digest in zip(names, _checksums(directory, names))}
    tmp = directory / f".{MANIFEST_FILE}.tmp"
    write_durably(tmp, json.dumps({"files": files, _HASH: _digest_of(files)}, indent=1) + "\n")
    os.replace(tmp, directory / MANIFEST_FILE)


def verify(directory: str | Path) -> str | None:
    """What is wrong with `directory` against its MANIFEST.json (naming the file), or None when
    every file it lists has its size and checksum; a missing manifest is damage too."""
    directory = Path(directory)
    manifest = directory / MANIFEST_FILE
    try:
        content = json.loads(manifest.read_text())
        files = content["files"]
        intact = content[_HASH] == _digest_of(files)
        listed = {name: (int(entry["bytes"]), str(entry[_HASH])) for name, entry in files.items()}
    except FileNotFoundError:
        return f"{manifest} is missing"
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{manifest} is unreadable ({type(e).__name__})"
    if not intact:
        return f"{manifest} does not match its own checksum"
    for name, (size, _) in listed.items():
        path = directory / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != size:
            return f"{path} has {path.stat().st_size} bytes, the manifest says {size}"
    names = list(listed)
    for name, digest in zip(names, _checksums(directory, names)):
        if digest != listed[name][1]:
            return f"{directory / name} does not match its checksum in the manifest"
    return None


def write_durably(path: Path, text: str) -> None:
    """`text` in `path`, on disk (fsync) when this returns; a storage fault names `path`."""
    with writing(path), open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
