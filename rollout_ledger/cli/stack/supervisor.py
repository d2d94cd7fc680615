"""Starts service processes (`rollout serve <name>`), waits for their /readyz, stops them with SIGTERM or kills them.

Used by `rollout up`, `make demo`, the integration tests (which kill processes with real signals) and the
benchmarks. Each child gets its own log file and HTTP port.

Each child leads a process group of its own (a new session), and its end is the end of the whole group: a vLLM
inference worker has an engine-core child process (and that one a worker of its own) holding memory and ports, which
would outlive a SIGKILL of the worker alone and make the engine of the worker started in its place die at start.
``kill`` sends SIGKILL to the group; ``stop`` sends SIGTERM to the service process only (it drains, then stops
its engine itself), then kills whatever of its group and descendants is left once it has exited.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from rollout_ledger.cli.stack.servers import free_port
from rollout_ledger.services import catalog
from rollout_ledger.shared.errors import InfraError

GROUP_EXIT_TIMEOUT_S = 10.0
"""How long ``kill``/``stop`` wait for a killed group's processes to be gone."""
STOP_ORDER = (*catalog.SERVICES, "")
"""Tiers stopped one after another on shutdown: the catalog's drain order ("" = anything else)."""


@dataclass
class ServiceProcess:
    """One `rollout serve <service>` child process."""

    service: str
    env: dict[str, str]
    log_dir: Path
    name: str = ""
    port: int = field(default_factory=free_port)
    command: tuple[str, ...] = ()
    """The child's argv; empty: ``python -m rollout_ledger.cli.main serve <service>`` of this code (a test runs
    another release's code this way, beside this one)."""
    proc: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        self.name = self.name or self.service

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    def start(self) -> ServiceProcess:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.update(self.env)
        env["ROLLOUT_HTTP_PORT"] = str(self.port)
        env["ROLLOUT_HTTP_HOST"] = "127.0.0.1"
        env.setdefault("ROLLOUT_WORKER_ID", self.name)
        env["ROLLOUT_LOG_FORMAT"] = "json"
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(
            list(self.command) or [sys.executable, "-m", "rollout_ledger.cli.main", "serve", self.service],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        return self

    def wait_ready(self, timeout_s: float = 60.0) -> ServiceProcess:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise InfraError(f"{self.name} exited with code {self.proc.returncode}; log:\n{self.tail_log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/readyz", timeout=1.0).status_code == 200:
                    return self
            time.sleep(0.1)
        raise InfraError(f"{self.name} not ready after {timeout_s}s; log:\n{self.tail_log()}")

    def tail_log(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: signal.Signals) -> None:
        if self.alive and self.proc is not None:
            self.proc.send_signal(sig)

    def descendants(self) -> list[psutil.Process]:
        """The service process's children, theirs, and so on, now (an engine core and its worker, for vLLM); none
        once the service process is reaped (its pid may be another process's then)."""
        if self.proc is None or self.proc.returncode is not None:
            return []
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:  # exited already
            return []

    def kill(self) -> None:
        """SIGKILL to the whole process group: a crash, nothing drains, no child (an engine core) survives."""
        if self.proc is None:
            return
        left = self.descendants()
        self._kill_group()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(GROUP_EXIT_TIMEOUT_S)
        self._end(left)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM to the service process and wait for its drain (it stops its engine itself); SIGKILL to the group
        after ``timeout_s``. What is left of its group and descendants once it exited is killed."""
        if self.proc is None:
            return None
        left = self.descendants()
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)
            self._exited(timeout_s)
            self._kill_group()  # the leftovers of a drained exit, or everything after the timeout
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(GROUP_EXIT_TIMEOUT_S)
        self._end(left)
        return self.proc.returncode

    def _exited(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the service process to exit, without reaping it: while it is an unreaped
        zombie its pid, the group's id, cannot be reused, so ``_kill_group`` reaches only its group."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                    return True
            except ChildProcessError:  # reaped already
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)

    def _kill_group(self) -> None:
        """SIGKILL to the process group the service process leads (``start_new_session``: its id is the pid), as
        long as the service process is not reaped (after that its pid may be another process's)."""
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    @staticmethod
    def _end(procs: list[psutil.Process]) -> None:
        """SIGKILL each of ``procs`` still running (one may have left the group; psutil checks that each is still
        the process it was) and wait until none is (a zombie whose parent has not reaped it yet holds no memory and
        no port: it counts as gone)."""
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.kill()
        deadline = time.monotonic() + GROUP_EXIT_TIMEOUT_S
        while any(_running(p) for p in procs):
            if time.monotonic() > deadline:
                raise InfraError(f"processes {[p.pid for p in procs if _running(p)]} survived SIGKILL for "
                                 f"{GROUP_EXIT_TIMEOUT_S}s")
            time.sleep(0.05)


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@dataclass
class Stack:
    """A set of service processes sharing one NATS and one Postgres."""

    nats_url: str
    database_url: str
    log_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    procs: list[ServiceProcess] = field(default_factory=list)
    service_env: dict[str, dict[str, str]] = field(default_factory=dict)
    """Settings of one service only, by service name: its NATS credentials on a server with authorization."""
    api_token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    """The scheduler's ROLLOUT_API_TOKEN (scopes read and write), generated for this stack unless given."""

    @property
    def api_headers(self) -> dict[str, str]:
        """Headers of a scheduler client with the write scope."""
        return {"Authorization": f"Bearer {self.api_token}"}

    def base_env(self) -> dict[str, str]:
        env = {"NATS_URL": self.nats_url, "DATABASE_URL": self.database_url}
        env.update(self.env)
        return env

    def start(self, service: str, name: str = "", wait: bool = True, port: int | None = None,
              command: tuple[str, ...] = (), **extra_env: str) -> ServiceProcess:
        env = self.base_env()
        env.update(self.service_env.get(service, {}))
        if service == "scheduler":
            env.setdefault("ROLLOUT_API_TOKEN", self.api_token)
        env.update({k.upper(): v for k, v in extra_env.items()})
        proc = ServiceProcess(service, env, self.log_dir, name=name, port=port or free_port(),
                              command=command).start()
        self.procs.append(proc)
        if wait:
            proc.wait_ready()
        return proc

    def stop_all(self, timeout_s: float = 30.0) -> None:
        """Drain in dependency order: the API, then env workers (their episodes still need inference), then
        inference workers, then recorders (so every event is recorded). Each tier gets SIGTERM at once and
        ``timeout_s`` to exit before SIGKILL."""
        for tier in STOP_ORDER:
            group = [p for p in self.procs if p.service == tier] if tier else [
                p for p in self.procs if p.service not in STOP_ORDER]
            for proc in group:
                proc.signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            for proc in group:
                proc.stop(max(0.1, deadline - time.monotonic()))
        self.procs.clear()

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()
