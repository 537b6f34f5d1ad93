"""How a controller process ends (rlactors.procs.supervision.exit_after_client_shutdown): with
its exit code, its procs gone and no traceback, even when the client's shutdown overruns."""

import subprocess
import sys
import textwrap

from support.linux import running

CONTROLLER = textwrap.dedent("""
    import os, sys
    from monarch.actor import Actor, endpoint, this_host
    import rlactors.procs.supervision as supervision

    class Pid(Actor):
        @endpoint
        def pid(self) -> int:
            return os.getpid()

    supervision.CLIENT_SHUTDOWN_WAIT_S = float(sys.argv[1])
    procs = this_host().spawn_procs(per_host={"procs": 1})
    print(procs.spawn("pid", Pid).pid.call_one().get(), flush=True)
    supervision.exit_after_client_shutdown(3)
""")


def run_controller(wait_s: float) -> tuple[subprocess.CompletedProcess, int]:
    done = subprocess.run([sys.executable, "-c", CONTROLLER, str(wait_s)], capture_output=True, text=True, timeout=300)
    return done, int(done.stdout.split()[0])


def test_a_controller_exits_with_its_code_its_procs_stopped_and_no_traceback():
    done, actor_pid = run_controller(wait_s=60)
    assert done.returncode == 3, done.stderr
    assert "Traceback" not in done.stderr and "warning" not in done.stderr, done.stderr
    assert not running(actor_pid)


def test_a_shutdown_that_overruns_its_wait_is_one_warning_line_and_the_code_holds():
    done, _ = run_controller(wait_s=0)
    assert done.returncode == 3, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert "warning: Monarch's client did not shut down within 0 s" in done.stderr.splitlines()
