"""Fault-injection suite: the measurement record. (tests/conftest.py sets the fast supervision
of rlactors.procs.supervision, which the detection times asserted here depend on.)

Each test records what it injected, how long detection took and what was lost through the
`fault_record` fixture; `benchmarks/faults_report.py` runs this suite with RLACTORS_FAULTS_REPORT
set and turns the records into benchmarks/results/faults.md.
"""

from __future__ import annotations

import json
import os

import pytest
from faultkit import REPORT_ENV


@pytest.fixture
def fault_record(request):
    """`record(fault, injected, detection_s, lost, **details)`: one line of the faults report."""

    def record(fault: str, injected: str, detection_s: float | None, lost: str, **details) -> None:
        path = os.environ.get(REPORT_ENV)
        if not path:
            return
        line = {"test": request.node.nodeid, "fault": fault, "injected": injected,
                "detection_s": detection_s, "lost": lost, **details}
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")

    return record
