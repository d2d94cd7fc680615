"""A real OpenEnv environment server for tests: the echo env of the ``openenv`` package (its ``openenv init``
template, rendered by its own CLI) served by uvicorn from the venv ``.venv-openenv`` (``make openenv``).

``ROLLOUT_OPENENV_PYTHON`` names another interpreter with ``openenv`` installed.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from rollout_ledger.cli.stack.servers import free_port
from tests.helpers import wait_for

REPO = Path(__file__).resolve().parents[1]
ENV_NAME = "echo_env"
"""The env ``openenv init`` renders (its template is an echo env: action ``message``, observation
``echoed_message`` and ``message_length``, reward ``min(0.1 * len(message), 1)``, never done)."""


def openenv_python() -> Path:
    """The interpreter with ``openenv``; fails the test with the fix when it is missing."""
    python = Path(os.environ.get("ROLLOUT_OPENENV_PYTHON", REPO / ".venv-openenv" / "bin" / "python"))
    if not python.exists():
        pytest.fail(f"no OpenEnv interpreter at {python}: run `make openenv` (a venv of its own for the openenv "
                    "package) or point ROLLOUT_OPENENV_PYTHON at a python with openenv==0.10.0")
    return python


@dataclass
class OpenEnvServer:
    """The echo env's server as a child process on a free port."""

    python: Path
    workdir: Path
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def render(self) -> None:
        """``openenv init echo_env`` into ``workdir`` (PATH without ``uv``: the CLI's ``uv lock`` is skipped,
        nothing is fetched)."""
        env = {**os.environ, "PATH": str(self.python.parent)}
        result = subprocess.run([str(self.python), "-m", "openenv.cli", "init", ENV_NAME, "--output-dir",
                                 str(self.workdir)], env=env, capture_output=True, timeout=120)
        app = self.workdir / ENV_NAME / "server" / "app.py"
        if not app.exists():
            raise AssertionError(f"openenv init made no {app}: {result.stdout[-2000:]!r} {result.stderr[-2000:]!r}")

    def start(self, timeout_s: float = 60.0) -> OpenEnvServer:
        self.port = free_port()
        log = open(self.workdir / "openenv-server.log", "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(
            [str(self.python), "-m", "uvicorn", f"{ENV_NAME}.server.app:app", "--host", "127.0.0.1", "--port",
             str(self.port), "--log-level", "warning"],
            cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(self._healthy, timeout_s, f"the OpenEnv echo server on port {self.port}")
        return self

    def _healthy(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"the OpenEnv server exited with {self.proc.returncode}: {self.log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{self.url}/health", timeout=1).status_code == 200
        return False

    def log_tail(self, limit: int = 3000) -> str:
        path = self.workdir / "openenv-server.log"
        return path.read_text(errors="replace")[-limit:] if path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
