"""Postgres failover benchmark: episodes through the real services on a primary with a synchronous standby
(rollout_ledger/cli/stack/pg_replication.py); the primary is killed with SIGKILL mid-batch, the standby promoted, and
then what became of every episode and of every turn the primary had committed.

The services and an exporter following a consumer (``rollout export --consumer failover --follow``) are given the
pair's multi-host DSN (``target_session_attrs=read-write``) as ``DATABASE_URL`` and nothing else: they find the new
primary by reconnecting. Once it takes writes, a second small batch goes through the scheduler. One JSON line:

- ``terminal`` / ``statuses`` / ``lost``: episodes in a terminal status, by status, and those that are not;
- ``duplicated``: rows stored twice (bench/chaos.py's queries: a second trajectory, a second kept step of a turn);
- ``acked_turns`` / ``acked_turns_missing``: turns committed on the primary (read on it just before the kill: the
  recorder acked their events to NATS) and how many of them the new primary lacks (synchronous replication: 0);
- ``promote_s``: from the kill to the standby accepting writes (``--promote-after-s`` plus ``pg_ctl promote``);
- ``stall_s``: from the kill to the first turn committed on the new primary (no progress meanwhile);
- ``exported`` / ``exported_duplicates`` / ``exported_missing``: records the exporter delivered, delivered twice,
  and completed episodes it did not deliver;
- ``crashed``: service processes (and the exporter) that exited (none should: they retry through the outage).

Exit status 1 when anything is lost, duplicated, missing or crashed. Usage:

    python -m bench.pg_failover                        # make failover: 400 episodes, promoted 5 s after the kill
    python -m bench.pg_failover --episodes 80 --promote-after-s 0   # CI size: tests/integration/test_pg_failover.py
    python -m bench.pg_failover --commit-cost          # one client's commits/s with and without the standby
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psycopg
from sqlalchemy import create_engine, text

from bench.chaos import Chaos, ChaosConfig
from rollout_ledger.cli.stack.pg_replication import PostgresPair
from rollout_ledger.cli.stack.servers import LocalInfra
from rollout_ledger.migrations.runner import sync_url
from rollout_ledger.shared.kit.settings import libpq_database_url
from rollout_ledger.shared.lifecycle import TERMINAL

TERMINAL_SQL = ",".join(f"'{s}'" for s in TERMINAL)


@dataclass
class FailoverConfig:
    """The size of a run and when its fault comes."""

    episodes: int = 400
    turns: int = 4
    kill_at: float = 0.3
    """The primary is killed once this fraction of the episodes is terminal."""
    promote_after_s: float = 5.0
    """From the kill to ``pg_ctl promote`` (what an operator or CloudNativePG takes to notice)."""
    fake_delay_s: float = 0.25
    concurrency: int = 8
    env_workers: int = 2
    inference_workers: int = 1
    after_episodes: int = 8
    """A second batch submitted once the standby is promoted (the scheduler's writes on the new primary)."""
    exporter: bool = True
    """Run ``rollout export --consumer failover --follow`` through the failover and check it delivered every
    trajectory exactly once."""
    timeout_s: float = 300.0
    """For each wait: the kill point, the first write on the new primary, every episode terminal."""
    poll_s: float = 0.05
    log_level: str = "INFO"
    keep_logs: str = ""
    """A folder the services' logs are copied to before the stack's files are removed (empty: not kept)."""
    echo: Callable[[str], None] = field(default=lambda s: print(s, file=sys.stderr, flush=True))


@dataclass
class FailoverResult:
    episodes: int
    terminal: int
    statuses: dict[str, int]
    lost: int
    duplicated: int
    terminal_at_kill: int
    acked_turns: int
    acked_turns_missing: int
    turns_on_new_primary: int
    promote_s: float
    stall_s: float
    quiesce_s: float
    """From the kill to the last episode terminal."""
    exported: int
    """Records the following exporter delivered (-1: not run)."""
    exported_duplicates: int
    exported_missing: int
    """Completed episodes the exporter did not deliver."""
    crashed: list[str]
    wall_s: float

    @property
    def ok(self) -> bool:
        return not (self.lost or self.duplicated or self.acked_turns_missing or self.crashed
                    or self.exported_duplicates or self.exported_missing)


def _wait(what: str, timeout_s: float, poll_s: float, check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s}s")
        time.sleep(poll_s)


def _turn_ids(node_psql: Callable[[str], str]) -> set[str]:
    return set(node_psql("select event_id from turns").split())


class Failover:
    """One run: the pair, the stack on its multi-host DSN, the batch, the kill and promotion, the figures."""

    def __init__(self, cfg: FailoverConfig) -> None:
        self.cfg = cfg
        self.root = Path(tempfile.mkdtemp(prefix="rollout-ledger-failover-", dir="/tmp"))
        os.chmod(self.root, 0o755)  # the servers run as nobody when we are root
        self.pair = PostgresPair(self.root / "pg")
        self.chaos = Chaos(ChaosConfig(episodes=cfg.episodes, turns=cfg.turns, fake_delay_s=cfg.fake_delay_s,
                                       concurrency=cfg.concurrency, env_workers=cfg.env_workers,
                                       inference_workers=cfg.inference_workers, log_level=cfg.log_level,
                                       echo=cfg.echo))

    def run(self) -> FailoverResult:
        cfg, pair, chaos = self.cfg, self.pair, self.chaos
        t0 = time.monotonic()
        try:
            pair.start()
            # the stack on the pair: no private Postgres of its own, the multi-host DSN as everyone's DATABASE_URL
            chaos.dev.infra = LocalInfra(nats_auth=True, database_url=pair.url)
            with chaos.dev:
                try:
                    return self._run(t0)
                finally:
                    if cfg.keep_logs:
                        shutil.copytree(chaos.dev.log_dir, cfg.keep_logs, dirs_exist_ok=True)
        finally:
            pair.stop()
            shutil.rmtree(self.root, ignore_errors=True)

    def _exporter(self) -> subprocess.Popen[bytes]:
        """``rollout export --consumer failover --follow`` on the multi-host DSN, JSONL files into ``export/``."""
        env = {k: v for k, v in os.environ.items() if k != "ROLLOUT_HTTP_PORT"}
        env.update(DATABASE_URL=self.pair.url, ROLLOUT_EXPORT_POLL_S="0.1", ROLLOUT_LOG_FORMAT="json",
                   ROLLOUT_LOG_LEVEL=self.cfg.log_level)
        log = open(self.root / "exporter.log", "ab")  # noqa: SIM115 - owned by the child process
        return subprocess.Popen([sys.executable, "-m", "rollout_ledger.cli.main", "export", "--consumer", "failover",
                                 "--follow", "--format", "jsonl", "--out", str(self.root / "export")],
                                env=env, stdout=log, stderr=log)

    def _exported(self) -> list[str]:
        """Episode ids of every record the exporter delivered (renamed files only, not ``.partial`` ones)."""
        return [json.loads(line)["episode_id"] for path in sorted((self.root / "export").glob("*.jsonl"))
                for line in path.read_text().splitlines()]

    def _run(self, t0: float) -> FailoverResult:
        cfg, pair, chaos = self.cfg, self.pair, self.chaos
        total = cfg.episodes + cfg.after_episodes
        engine = create_engine(sync_url(pair.url), pool_pre_ping=True)
        exporter = self._exporter() if cfg.exporter else None
        try:
            chaos.submit(cfg.episodes)
            kill_at = max(1, int(cfg.episodes * cfg.kill_at))
            _wait(f"{kill_at} episodes terminal", cfg.timeout_s, cfg.poll_s,
                  lambda: chaos.terminal(engine) >= kill_at)
            acked = _turn_ids(pair.primary.psql)  # committed, hence acked or about to be: all on the standby
            terminal_at_kill = int(pair.primary.psql(f"select count(*) from episodes where status in ({TERMINAL_SQL})"))
            t_kill = time.monotonic()
            pair.kill_primary()
            cfg.echo(f"primary killed with {terminal_at_kill}/{cfg.episodes} episodes terminal, "
                     f"{len(acked)} turns committed")
            time.sleep(cfg.promote_after_s)  # the outage an operator's (or the operator's) reaction takes
            pair.promote()
            promote_s = time.monotonic() - t_kill
            base = int(pair.standby.psql("select count(*) from turns"))
            _wait("a turn committed on the new primary", cfg.timeout_s, cfg.poll_s,
                  lambda: int(pair.standby.psql("select count(*) from turns")) > base)
            stall_s = time.monotonic() - t_kill
            cfg.echo(f"promoted after {promote_s:.2f} s; first new turn {stall_s:.2f} s after the kill")
            if cfg.after_episodes:
                chaos.submit(cfg.after_episodes, timeout_s=cfg.timeout_s)

            def settled() -> bool:
                if chaos.terminal(engine) < total:
                    return False
                with engine.connect() as conn:  # and the trajectory of each completed one (the same transaction)
                    unfinished = int(conn.execute(text(
                        "select count(*) from episodes e where batch_id = any(:b) and status = 'completed' "
                        "and not exists (select 1 from trajectories t where t.episode_id = e.id)"),
                        {"b": chaos.batch_ids}).scalar() or 0)
                return unfinished == 0

            try:
                _wait("every episode terminal", cfg.timeout_s, cfg.poll_s * 10, settled)
            except TimeoutError as exc:
                cfg.echo(str(exc))
            quiesce_s = time.monotonic() - t_kill
            done = chaos.terminal(engine)
            fig = chaos.figures(engine)
            with engine.connect() as conn:
                completed = {str(r[0]) for r in conn.execute(text(
                    "select id from episodes where batch_id = any(:b) and status = 'completed'"),
                    {"b": chaos.batch_ids})}
            exported: list[str] = []
            if exporter is not None:
                try:
                    _wait("every trajectory exported", cfg.timeout_s, cfg.poll_s * 10,
                          lambda: exporter.poll() is not None or len(set(self._exported())) >= len(completed))
                except TimeoutError as exc:
                    cfg.echo(str(exc))
                exported = self._exported()
            missing = len(acked - _turn_ids(pair.standby.psql))
            stack = chaos.dev.stack
            crashed = [p.name for p in stack.procs if not p.alive] if stack is not None else []
            if exporter is not None and exporter.poll() is not None:
                crashed.append("exporter")
        finally:
            engine.dispose()
            if exporter is not None and exporter.poll() is None:
                exporter.send_signal(signal.SIGTERM)
                try:
                    exporter.wait(30)
                except subprocess.TimeoutExpired:
                    exporter.kill()
                    exporter.wait(5)
            if cfg.keep_logs and (self.root / "exporter.log").exists():
                Path(cfg.keep_logs).mkdir(parents=True, exist_ok=True)
                shutil.copy(self.root / "exporter.log", Path(cfg.keep_logs) / "exporter.log")
        return FailoverResult(
            episodes=total, terminal=done, statuses=fig["statuses"], lost=total - done,
            duplicated=fig["duplicated"], terminal_at_kill=terminal_at_kill, acked_turns=len(acked),
            acked_turns_missing=missing, turns_on_new_primary=int(pair.standby.psql("select count(*) from turns")),
            promote_s=round(promote_s, 2), stall_s=round(stall_s, 2), quiesce_s=round(quiesce_s, 1),
            exported=len(exported) if exporter is not None else -1,
            exported_duplicates=len(exported) - len(set(exported)),
            exported_missing=len(completed - set(exported)) if exporter is not None else 0,
            crashed=crashed, wall_s=round(time.monotonic() - t0, 1))


def commit_cost(commits: int = 2000) -> dict[str, float]:
    """Commits per second of one client on the pair's primary, each a one-row insert, with the standby in the commit
    (``synchronous_commit=on``) and without it (``local``, the same server): the price of the guarantee on loopback."""
    root = Path(tempfile.mkdtemp(prefix="rollout-ledger-commit-cost-", dir="/tmp"))
    os.chmod(root, 0o755)
    out: dict[str, float] = {}
    try:
        with PostgresPair(root) as pair, psycopg.connect(libpq_database_url(pair.url), autocommit=True) as conn:
            conn.execute("create table commit_probe (x int)")
            for mode in ("on", "local", "on", "local"):  # twice each, interleaved: the second pair is reported
                conn.execute(f"set synchronous_commit = {mode}")
                t0 = time.perf_counter()
                for i in range(commits):
                    conn.execute("insert into commit_probe values (%s)", (i,))
                out[f"commits_per_s_{mode}"] = round(commits / (time.perf_counter() - t0))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    defaults = FailoverConfig()
    for name in ("episodes", "after_episodes", "turns", "concurrency", "env_workers", "inference_workers"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    for name in ("kill_at", "promote_after_s", "fake_delay_s", "timeout_s"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(defaults, name))
    parser.add_argument("--no-exporter", dest="exporter", action="store_false", help="run no following exporter")
    parser.add_argument("--keep-logs", default="", help="copy the services' logs to this folder")
    parser.add_argument("--log-level", default=defaults.log_level)
    parser.add_argument("--commit-cost", action="store_true",
                        help="only measure commits/s with and without the standby in the commit")
    args = parser.parse_args(argv)
    if args.commit_cost:
        print(json.dumps({"run": "pg_commit_cost", **commit_cost()}), flush=True)
        return 0
    del args.commit_cost
    result = Failover(FailoverConfig(**vars(args))).run()
    print(json.dumps({"run": "pg_failover", **asdict(result)}), flush=True)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
