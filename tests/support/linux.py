"""Facts of the running Linux kernel, and of its processes, that tests depend on."""

from __future__ import annotations

import os
import re
from pathlib import Path


def kernel_at_least(major: int, minor: int) -> bool:
    release = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return release is not None and (int(release[1]), int(release[2])) >= (major, minor)


# A pidfd keeps its process's exit status after the reap (PIDFD_INFO_EXIT) since Linux 6.15.
PIDFD_KEEPS_EXIT_STATUS = kernel_at_least(6, 15)


def running(pid: int) -> bool:
    """Whether `pid` runs (an exited process not yet reaped by its parent does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
