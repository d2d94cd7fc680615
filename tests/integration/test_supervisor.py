"""The supervisor ends a service process with its whole process group and descendants: a vLLM inference worker has
an engine-core child (and that one a worker), and a SIGKILL of the worker alone left them holding memory and ports.
Real processes and signals: a stand-in service that starts children (one ignores SIGTERM, one leaves the group) and
drains on SIGTERM as a service does."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import psutil

from rollout_ledger.cli.stack.supervisor import ServiceProcess
from tests.helpers import wait_for

CHILD = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # an engine core that does not stop on its own
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # its worker
if len(sys.argv) > 1:
    subprocess.Popen([sys.executable, "-c", "import os, time; os.setsid(); time.sleep(600)"])  # left the group
time.sleep(600)
"""

SERVICE = """
import signal, subprocess, sys, time
drains = sys.argv[1] == "drains"
subprocess.Popen([sys.executable, "-c", sys.argv[2], *sys.argv[3:]])
def on_term(*_):
    time.sleep(0.3)  # the drain
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term if drains else signal.SIG_IGN)
time.sleep(600)
"""


def _service(tmp_path: Path, *, drains: bool = True,
             setsid_child: bool = False) -> tuple[ServiceProcess, list[psutil.Process]]:
    """A started stand-in service and its descendants once they all run."""
    argv = [sys.executable, "-c", SERVICE, "drains" if drains else "stays", CHILD,
            *(["setsid"] if setsid_child else [])]
    proc = ServiceProcess("stand-in", {}, tmp_path, command=tuple(argv)).start()
    expected = 2 + setsid_child
    kids = wait_for(lambda: k if len(k := proc.descendants()) == expected else [], 30,
                    f"{expected} descendants of the stand-in service")
    return proc, kids


def _survivors(procs: list[psutil.Process]) -> list[psutil.Process]:
    def running(p: psutil.Process) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    return [p for p in procs if running(p)]


def test_kill_ends_the_whole_group_and_every_descendant(tmp_path: Path) -> None:
    proc, kids = _service(tmp_path, setsid_child=True)
    assert proc.proc is not None
    wait_for(lambda: [k.pid for k in kids if os.getsid(k.pid) == k.pid], 30, "a descendant to leave the group")
    proc.kill()
    assert proc.proc.returncode == -9
    assert _survivors(kids) == [], "no child of the killed service survives"
    proc.kill()  # again: nothing left, nothing raised


def test_stop_drains_the_service_then_ends_what_it_left(tmp_path: Path) -> None:
    proc, kids = _service(tmp_path)
    began = time.monotonic()
    assert proc.stop(timeout_s=20) == 0, "SIGTERM reaches the service, which drains and exits 0"
    assert time.monotonic() - began < 10, "the drain, not the timeout"
    assert _survivors(kids) == [], "the child that ignores SIGTERM is killed once the service exited"


def test_stop_kills_the_group_of_a_service_that_does_not_drain(tmp_path: Path) -> None:
    proc, kids = _service(tmp_path, drains=False)
    assert proc.stop(timeout_s=1) == -9
    assert not proc.alive
    assert _survivors(kids) == []
