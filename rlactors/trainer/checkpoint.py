"""Trainer checkpoint directories: layout, atomic commit, verification, and finding the newest
intact one.

    <root>/step_00000010/
        dcp/                  sharded model + optimizer state (torch.distributed.checkpoint)
        hf/                   the policy as a HF checkpoint dir (safetensors + config + tokenizer),
            MANIFEST.json     with the size and checksum of each of its files
        trainer_state.json    step, policy version
        MANIFEST.json         the size and checksum of every file above, written after them
        COMPLETE              written last

A checkpoint is written under `<root>/.step_00000010.partial` and renamed into place only after
COMPLETE is on disk, so a crash mid-save leaves a hidden partial dir, never a step dir that looks
complete. `latest_checkpoint` only returns step dirs holding COMPLETE; `newest_intact` also checks
their files against the manifest and falls back past damaged ones, naming the damage.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlactors.storage.manifest import verify, write_durably, write_manifest

DCP_DIR = "dcp"
HF_DIR = "hf"
STATE_FILE = "trainer_state.json"
COMPLETE_FILE = "COMPLETE"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def checkpoint_dir(root: str | Path, step: int) -> Path:
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    return Path(root) / f"step_{step:08d}"


def partial_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f".{checkpoint_dir(root, step).name}.partial"


def is_complete(path: str | Path) -> bool:
    return (Path(path) / COMPLETE_FILE).is_file()


def looks_like_trainer_checkpoint(path: str | Path) -> bool:
    path = Path(path)
    return any((path / name).exists() for name in (DCP_DIR, STATE_FILE, COMPLETE_FILE))


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """(step, dir) of the complete step dirs under `root`, newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(((int(m.group(1)), p) for p in root.iterdir()
                   if (m := _STEP_DIR.match(p.name)) and p.is_dir() and is_complete(p)), reverse=True)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The complete step dir with the highest step under `root`, or None."""
    found = complete_checkpoints(root)
    return found[0][1] if found else None


def newest_intact(root: str | Path, through_step: int | None = None,
                  say: Callable[[str], None] = print) -> Path | None:
    """The newest complete checkpoint under `root` (of a step <= `through_step`, when given) whose
    files match its manifest, or None. Each damaged one passed over is said, one line each."""
    for step, path in complete_checkpoints(root):
        if through_step is not None and step > through_step:
            continue
        damage = verify(path)
        if damage is None:
            return path
        say(f"checkpoint {path} is damaged: {damage}; falling back to an older checkpoint")
    return None


def prune(root: str | Path, keep: int) -> list[Path]:
    """Deletes all but the newest `keep` complete checkpoints (0: keeps all); the deleted."""
    old = [path for _, path in complete_checkpoints(root)[keep:]] if keep else []
    for path in old:
        shutil.rmtree(path, ignore_errors=True)
    return old


def read_state(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not is_complete(path):
        raise ValueError(f"{path} is not a complete checkpoint ({COMPLETE_FILE} missing): the save did not finish")
    return json.loads((path / STATE_FILE).read_text())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(partial: Path, final: Path, state: dict[str, Any]) -> None:
    """Writes the state file, the manifests (of hf/, then of everything) and COMPLETE into
    `partial`, then renames it to `final`.

    An existing `final` (the same step saved again) is replaced: moved aside, then deleted.
    """
    write_durably(partial / STATE_FILE, json.dumps(state, indent=2) + "\n")
    if (partial / HF_DIR).is_dir():
        write_manifest(partial / HF_DIR)
    write_manifest(partial, later=(COMPLETE_FILE,))
    write_durably(partial / COMPLETE_FILE, "")
    _fsync_dir(partial)
    replaced = final.with_name(f".{final.name}.replaced")
    if final.exists():
        shutil.rmtree(replaced, ignore_errors=True)
        final.rename(replaced)
    partial.rename(final)
    _fsync_dir(final.parent)
    shutil.rmtree(replaced, ignore_errors=True)
