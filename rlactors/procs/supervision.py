"""How Monarch watches procs. The variables must be in the environment before Monarch starts;
actor procs inherit them.

Monarch polls each actor mesh: it asks the host agent for its procs' OS status (an exited proc is
seen there, with its exit status, within a poll), then asks the proc's own agent for its actors'
states. An unanswered state query blocks that mesh's poll, and once it has waited
GET_ACTOR_STATE_MAX_IDLE the proc counts as dead ("The process likely crashed"), though a
CPU-starved or stopped proc is alive. So here that wait is a late backstop, and
rlactors.procs.liveness tells dead from slow instead: a pidfd for exits (at once), pings for silence
(lost after controller.unresponsive_timeout_s, which config.py bounds below the backstop).

- HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY: how often proc and actor states are polled
  (Monarch's default, 10 s, is how long a dead proc on another machine would go unseen).
- HYPERACTOR_MESH_GET_ACTOR_STATE_MAX_IDLE: the backstop above.
- HYPERACTOR_MESH_GET_PROC_STATE_MAX_IDLE, HYPERACTOR_MESSAGE_DELIVERY_TIMEOUT and
  HYPERACTOR_MESH_ORPHAN_TIMEOUT (Monarch's defaults: 1 min, 30 s, 1 min) run on clocks that go
  on while a process is stopped: a run whose processes were stopped for 75 s (SIGSTOP, Ctrl-Z)
  lost its replica (it exited with code 0) and links between its procs ("failed to receive ack
  within timeout 30s") when it went on. Set to the backstop too: an exit is still seen at once
  (the procs of a killed controller end with it), silence after controller.unresponsive_timeout_s
  (rlactors.procs.liveness, which tells its own pauses from silence).
- HYPERACTOR_MESH_SUPERVISION_WATCHDOG_TIMEOUT: how long a caller waits for any supervision
  message before it counts the mesh as unreachable; Monarch wants it >= the poll frequency + the
  state-query wait + the proc-state-query wait.
"""

from __future__ import annotations

import os

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
