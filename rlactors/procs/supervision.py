"""How Monarch watches procs. The variables must be in the environment before Monarch starts;
actor procs inherit them.

Monarch counts a proc whose actor-state query goes unanswered for GET_ACTOR_STATE_MAX_IDLE as
dead, though a CPU-starved or stopped proc is alive. So here that wait is a late backstop, and
rlactors.procs.liveness tells dead from slow instead (lost after controller.unresponsive_timeout_s,
which config.py bounds below the backstop).

- HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY: how often proc and actor states are polled.
- HYPERACTOR_MESH_GET_ACTOR_STATE_MAX_IDLE: the backstop.
- HYPERACTOR_MESH_GET_PROC_STATE_MAX_IDLE, HYPERACTOR_MESSAGE_DELIVERY_TIMEOUT,
  HYPERACTOR_MESH_ORPHAN_TIMEOUT: the backstop too, as their clocks run while a process is stopped.
- HYPERACTOR_MESH_SUPERVISION_WATCHDOG_TIMEOUT: >= the poll frequency + both state-query waits.
Why each: docs/ARCHITECTURE.md, "Failover". A controller exits through `exit_after_client_shutdown`.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

from rlactors.config import MONARCH_STATE_QUERY_WAIT_S

FAST_SUPERVISION = {
    "HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY": "1s",
    "HYPERACTOR_MESH_GET_ACTOR_STATE_MAX_IDLE": f"{MONARCH_STATE_QUERY_WAIT_S}s",
    "HYPERACTOR_MESH_GET_PROC_STATE_MAX_IDLE": f"{MONARCH_STATE_QUERY_WAIT_S}s",
    "HYPERACTOR_MESSAGE_DELIVERY_TIMEOUT": f"{MONARCH_STATE_QUERY_WAIT_S}s",
    "HYPERACTOR_MESH_ORPHAN_TIMEOUT": f"{MONARCH_STATE_QUERY_WAIT_S}s",
    "HYPERACTOR_MESH_SUPERVISION_WATCHDOG_TIMEOUT": f"{2 * MONARCH_STATE_QUERY_WAIT_S + 120}s",
}


def use_fast_supervision(force: bool = False) -> None:
    """Sets FAST_SUPERVISION in this process's environment (keeping values already set, unless
    `force`); call it before anything starts Monarch."""
    for name, value in FAST_SUPERVISION.items():
        if force:
            os.environ[name] = value
        else:
            os.environ.setdefault(name, value)


CLIENT_SHUTDOWN_WAIT_S = 60.0
HOST_FLUSH_WAIT_S = 1.0  # per final flush; one to a peer already gone (a cancelled Slurm job) waits it out


def exit_after_client_shutdown(code: int) -> NoReturn:
    """Shuts down this process's Monarch client (if it has one), allowing CLIENT_SHUTDOWN_WAIT_S
    where Monarch's exit hook allows one second, then exits with `code`. A shutdown that overruns
    even that is one stderr line, not a traceback; the procs end with this process either way."""
    if "monarch.actor" in sys.modules:  # else Monarch never started: nothing to shut down
        from monarch.actor import shutdown_context

        try:
            shutdown_context(host_timeout=HOST_FLUSH_WAIT_S).get(timeout=CLIENT_SHUTDOWN_WAIT_S)
        except TimeoutError:
            print(f"warning: Monarch's client did not shut down within {CLIENT_SHUTDOWN_WAIT_S:g} s", file=sys.stderr)
    sys.exit(code)
