"""Postgres failover under load (bench/pg_failover.py at CI size): the real services and a following exporter run on
a primary with a synchronous standby, given only the pair's multi-host DSN; the primary is killed with SIGKILL
mid-batch and the standby promoted. Every episode must complete once, every turn the primary had committed (and the
recorder acked) must be on the new primary, the exporter must deliver every trajectory exactly once, and no
service may crash. And what that rests on: the pair acknowledges a commit only once the standby has it, and a
pooled connection to a server that turned read-only is dropped, not reused."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from dataclasses import asdict
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import text

from bench.pg_failover import Failover, FailoverConfig
from rollout_ledger.cli.stack.pg_replication import PostgresPair
from rollout_ledger.services.recorder.store import Store
from rollout_ledger.services.scheduler.batch_store import store_errors
from rollout_ledger.shared.db import create_engine
from rollout_ledger.shared.errors import StoreError
from rollout_ledger.shared.kit.settings import libpq_database_url
from tests.helpers import wait_for


def test_primary_killed_mid_batch_loses_nothing(tmp_path: Path, model_dir: str) -> None:
    cfg = FailoverConfig(episodes=80, after_episodes=8, turns=4, kill_at=0.3, promote_after_s=0.0,
                         fake_delay_s=0.25, concurrency=8, env_workers=2, inference_workers=1, timeout_s=60.0,
                         keep_logs=str(tmp_path / "logs"))
    result = Failover(cfg).run()
    print(asdict(result))
    print(f"failover stall (kill -> first turn committed on the new primary): {result.stall_s} s")
    assert 0 < result.terminal_at_kill < cfg.episodes, "the primary must die mid-batch"
    assert result.statuses == {"completed": 88} and result.lost == 0
    assert result.duplicated == 0
    assert result.acked_turns > 0 and result.acked_turns_missing == 0
    assert result.turns_on_new_primary >= 88 * cfg.turns
    assert result.exported == 88 and result.exported_duplicates == 0 and result.exported_missing == 0
    assert result.crashed == []
    assert result.stall_s < 30.0, "the services reconnect within their store backoff (a few seconds)"


async def test_a_connection_to_a_server_turned_read_only_is_dropped(database_url: str) -> None:
    """A pooled connection that still answers but may no longer write (a primary demoted in place, simulated by the
    session setting ``default_transaction_read_only``): the write fails as a retryable error and the connection is
    dropped, so the retry gets a fresh one, for SQLAlchemy's statements (scheduler) and the recorder's raw driver
    connection alike."""
    engine = create_engine(database_url, pool_size=1)
    try:
        async with engine.begin() as conn:
            await conn.execute(text("create table ro_probe (x int)"))
        async with engine.begin() as conn:
            await conn.execute(text("set session default_transaction_read_only = on"))
        with pytest.raises(StoreError) as scheduler_error, store_errors("insert"):
            async with engine.begin() as conn:
                await conn.execute(text("insert into ro_probe values (1)"))
        assert scheduler_error.value.retryable
        async with engine.begin() as conn:  # the retry: a new connection, writable
            assert (await conn.execute(text("show default_transaction_read_only"))).scalar() == "off"
            await conn.execute(text("insert into ro_probe values (1)"))

        recorder = Store(engine)
        async with recorder.transaction() as tx:
            await tx.pg.execute("set session default_transaction_read_only = on")
        with pytest.raises(StoreError) as recorder_error:
            async with recorder.transaction() as tx:
                await tx.pg.execute("insert into ro_probe values (2)")
        assert recorder_error.value.retryable
        async with recorder.transaction() as tx:
            cur = await tx.pg.execute("show default_transaction_read_only")
            assert (await cur.fetchone()) == ("off",)
            await tx.pg.execute("insert into ro_probe values (2)")
        async with engine.connect() as conn:
            assert (await conn.execute(text("select array_agg(x order by x) from ro_probe"))).scalar() == [1, 2]
    finally:
        await engine.dispose()


def test_the_pair_acknowledges_a_commit_only_once_the_standby_has_it() -> None:
    """The guarantee the failover rests on (rollout_ledger/cli/stack/pg_replication.py): with the standby down, a commit
    on the primary waits (``SyncRep``) instead of returning; once the standby is back the commit returns and the row is
    on the standby."""
    root = Path(tempfile.mkdtemp(prefix="rollout-ledger-pair-", dir="/tmp"))
    os.chmod(root, 0o755)  # the servers run as nobody when we are root
    try:
        with PostgresPair(root) as pair:
            assert pair.primary.psql("show synchronous_commit") == "on"
            pair.primary.psql("create table sync_probe (x int)")
            pair.standby.stop()
            committed = threading.Event()

            def insert() -> None:
                with psycopg.connect(libpq_database_url(pair.primary.url), autocommit=True) as conn:
                    conn.execute("insert into sync_probe values (1)")
                committed.set()

            writer = threading.Thread(target=insert, daemon=True)
            writer.start()
            wait_for(lambda: pair.primary.psql(
                "select count(*) from pg_stat_activity where wait_event = 'SyncRep'") == "1", 30,
                "the commit waiting for the standby")
            assert not committed.is_set(), "a commit no standby has must not return"
            pair.standby.start_standby_of(pair.primary)
            writer.join(30)
            assert committed.is_set(), "the commit returns once the standby is back"
            wait_for(lambda: pair.standby.psql("select count(*) from sync_probe") == "1", 30, "the row on the standby")
    finally:
        shutil.rmtree(root, ignore_errors=True)
