"""How fast Monarch notices a dead proc. The variables must be in the environment before Monarch
starts; actor procs inherit them.

- HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY: how often proc and actor states are polled
  (Monarch's default, 10 s, is how long a dead replica would keep its requests).
- HYPERACTOR_MESH_GET_ACTOR_STATE_MAX_IDLE: how long an unanswered state query waits before the
  actor counts as dead. A query in flight when its proc is SIGKILLed can go unanswered, and
  with Monarch's default (30 s) a killed replica was then noticed only after 30 s, in about one
  run of tests/faults in three.
"""

from __future__ import annotations

import os

FAST_SUPERVISION = {
    "HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY": "1s",
    "HYPERACTOR_MESH_GET_ACTOR_STATE_MAX_IDLE": "1s",
}


def use_fast_supervision(force: bool = False) -> None:
    """Sets FAST_SUPERVISION in this process's environment (keeping values already set, unless
    `force`); call it before anything starts Monarch."""
    for name, value in FAST_SUPERVISION.items():
        if force:
            os.environ[name] = value
        else:
            os.environ.setdefault(name, value)
