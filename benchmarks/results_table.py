"""Results tables: each benchmark adds one dated, commit-stamped row per run to its own Markdown table.

A row starts with the date, the machine, the commit and the command, then the benchmark's
figures. `append_row` adds it under the last row of the file's table with the same header, so
notes below the table stay where they are; a file without that table (or no file) gets it at the
end, under the title.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
STAMP = ("date", "machine", "commit", "command")


def commit() -> str:
    """The short hash of HEAD, with `+changes` when tracked files other than results differ from
    it; "uncommitted" outside a git checkout."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)

    try:
        head = git("rev-parse", "--short", "HEAD")
    except OSError:  # no git here
        return "uncommitted"
    if head.returncode != 0:
        return "uncommitted"
    # results files change as benchmarks run: only the code counts
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results").stdout.strip()
    return head.stdout.strip() + ("+changes" if changed else "")


def cpu_model() -> str:
    """The CPU's model name (Linux), else the machine type."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def machine(device: str) -> str:
    """The GPU(s) a CUDA run used, or the CPU's model and core count."""
    if device == "cuda":
        import torch

        count = torch.cuda.device_count()
        return torch.cuda.get_device_name(0) + (f" x{count}" if count > 1 else "")
    return f"{cpu_model()}, {os.cpu_count()} cores"


def command(argv: Sequence[str] | None = None, launcher: str = "python") -> str:
    """How this run was started, from the repository root: `python benchmarks/x.py --flag ...`."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve()
    name = script.relative_to(ROOT).as_posix() if script.is_relative_to(ROOT) else argv[0]
    return shlex.join([*shlex.split(launcher), name, *argv[1:]])


def _line(cells: Sequence[object]) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |"


def append_row(path: Path, title: str, columns: Sequence[str], figures: Sequence[object], *, device: str = "cpu",
               launcher: str = "python", machine_name: str | None = None, command_line: str | None = None) -> str:
    """Adds `date | machine | commit | command | *figures` to the table of `columns` in `path`
    (creating the file as `# title` with the table on first use); returns the row. The machine is
    `device`'s and the command this process's unless `machine_name` and `command_line` say."""
    if len(figures) != len(columns):
        raise ValueError(f"{path.name}: {len(figures)} figures for {len(columns)} columns {list(columns)}")
    header = _line([*STAMP, *columns])
    row = _line([datetime.date.today().isoformat(), machine_name or machine(device), commit(),
                 f"`{command_line or command(launcher=launcher)}`", *figures])
    lines = path.read_text().splitlines() if path.exists() else [f"# {title}"]
    if header in lines:
        end = len(lines) - lines[::-1].index(header)  # just below the last such header
        while end < len(lines) and lines[end].startswith("|"):
            end += 1
        lines.insert(end, row)
    else:
        lines += ["", header, "|" + "---|" * (len(STAMP) + len(columns)), row]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return row
