"""One Postgres role per service (migration 0012): each login is refused what its service must not do, and the real
scheduler, recorder and exporter run under their own logins end to end."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from psycopg import errors, sql

from rollout_ledger.cli.stack.supervisor import Stack
from rollout_ledger.migrations.logins import SERVICE_ROLES, create_login, libpq, login_url
from rollout_ledger.shared.db import metadata
from tests.helpers import wait_for

Logins = dict[str, str]
"""Service -> the DSN of its own login user."""

WRITES = ("INSERT", "UPDATE", "DELETE", "TRUNCATE")

ALLOWED_WRITES: dict[str, dict[str, set[str]]] = {
    "scheduler": {"batches": {"INSERT", "UPDATE"}, "episodes": {"INSERT", "UPDATE"},
                  "policy_versions": {"INSERT"}, "policy_worker_states": {"INSERT", "UPDATE"},
                  "trajectory_feed": {"INSERT"}},
    "recorder": {"episodes": {"UPDATE"}, "turns": {"INSERT", "UPDATE"}, "steps": {"INSERT", "UPDATE"},
                 "trajectories": {"INSERT", "UPDATE"}, "attempt_failures": {"INSERT"},
                 "attempt_resumes": {"INSERT"}, "dead_letters": {"INSERT"}, "trajectory_feed": {"INSERT"}},
    "exporter": {"export_cursors": {"INSERT", "UPDATE"}},
    "feed-prune": {"export_cursors": {"INSERT", "UPDATE"}, "trajectory_feed": {"DELETE"}},
    "scorer": {"export_cursors": {"INSERT", "UPDATE"}, "reward_scores": {"INSERT", "UPDATE"},
               "logprob_audits": {"INSERT", "UPDATE"}},
}
"""The whole write surface of each login: anything not listed here must be refused."""


@pytest.fixture
def logins(database_url: str) -> Iterator[Logins]:
    """A login user per service (unique names: roles are cluster-wide), dropped after the test."""
    suffix = uuid.uuid4().hex[:8]
    users = {service: f"t_{service.replace('-', '_')}_{suffix}" for service in SERVICE_ROLES}
    for service, user in users.items():
        create_login(database_url, service, user, f"pw-{user}")
    yield {service: login_url(database_url, user, f"pw-{user}") for service, user in users.items()}
    with psycopg.connect(libpq(database_url), autocommit=True) as conn:
        for user in users.values():
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(user)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(user)))


def _refused(url: str, statement: str) -> None:
    with psycopg.connect(libpq(url), autocommit=True) as conn, pytest.raises(errors.InsufficientPrivilege):
        conn.execute(statement)


def test_each_login_has_exactly_its_services_write_grants(logins: Logins) -> None:
    tables = sorted(metadata.tables)
    for service, url in logins.items():
        with psycopg.connect(libpq(url)) as conn:
            assert conn.execute("SELECT rolsuper OR rolcreaterole OR rolcreatedb FROM pg_roles "
                                "WHERE rolname = current_user").fetchone() == (False,)
            for table in tables:
                granted = {priv for priv in WRITES if conn.execute(
                    "SELECT has_table_privilege(current_user, %s, %s)", (table, priv)).fetchone() == (True,)}
                assert granted == ALLOWED_WRITES[service].get(table, set()), (service, table)
                # everyone reads what it needs; the schema check reads alembic_version
            assert conn.execute("SELECT count(*) FROM alembic_version").fetchone() == (1,)


def test_each_login_is_refused_what_its_service_must_not_do(logins: Logins) -> None:
    # the exporter reads and moves its cursors, nothing else
    with psycopg.connect(libpq(logins["exporter"]), autocommit=True) as conn:
        conn.execute("SELECT count(*) FROM trajectories")
        conn.execute("INSERT INTO export_cursors (consumer) VALUES ('roles-test')")
        conn.execute("UPDATE export_cursors SET deliveries = 1 WHERE consumer = 'roles-test'")
    for statement in ("UPDATE trajectories SET reward = 1", "DELETE FROM trajectories", "DELETE FROM episodes",
                      "TRUNCATE trajectory_feed", "DELETE FROM export_cursors", "DELETE FROM trajectory_feed",
                      "INSERT INTO dead_letters (source, subject, reason, payload) VALUES ('x', 'x', 'x', '')"):
        _refused(logins["exporter"], statement)
    # the recorder writes the record, never changes the schema or removes anything
    for statement in ("DROP TABLE turns", "ALTER TABLE turns ADD COLUMN x int", "TRUNCATE turns",
                      "DELETE FROM turns", "DELETE FROM dead_letters", "DELETE FROM episodes",
                      "UPDATE batches SET cancelled_at = now()", "CREATE TABLE public.x (a int)",
                      "UPDATE policy_versions SET notes = 'x'", "DELETE FROM alembic_version"):
        _refused(logins["recorder"], statement)
    with psycopg.connect(libpq(logins["recorder"])) as conn:  # its COPY staging tables
        conn.execute("CREATE TEMP TABLE stage ON COMMIT DELETE ROWS AS SELECT * FROM turns WITH NO DATA")
    # the scheduler plans and cancels; the recorder's tables are not its to write
    for statement in ("INSERT INTO turns (event_id) VALUES ('x')", "UPDATE trajectories SET reward = 1",
                      "UPDATE steps SET superseded = true", "DELETE FROM episodes", "DELETE FROM batches",
                      "TRUNCATE episodes", "DROP VIEW v_batch_progress",
                      "INSERT INTO dead_letters (source, subject, reason, payload) VALUES ('x', 'x', 'x', '')",
                      "CREATE TEMP TABLE x (a int)"):
        _refused(logins["scheduler"], statement)
    # the feed pruner deletes feed entries and nothing else
    with psycopg.connect(libpq(logins["feed-prune"]), autocommit=True) as conn:
        conn.execute("DELETE FROM trajectory_feed WHERE false")
    for statement in ("DELETE FROM trajectories", "DELETE FROM reward_scores", "UPDATE episodes SET reward = 0"):
        _refused(logins["feed-prune"], statement)


def test_the_services_run_under_their_own_logins(stack: Stack, logins: Logins, database_url: str,
                                                  tmp_path: Path) -> None:
    from rollout_ledger.client.reader import TrajectoryReader
    from rollout_ledger.services.exporter.export import export_batch
    from rollout_ledger.services.exporter.retention import prune

    stack.start("inference-worker", ROLLOUT_ENGINE="fake")
    stack.start("env-worker")
    stack.start("recorder", DATABASE_URL=logins["recorder"])
    url = stack.start("scheduler", DATABASE_URL=logins["scheduler"], ROLLOUT_API_TOKEN="roles-test").url
    api = httpx.Client(base_url=url, headers={"Authorization": "Bearer roles-test"}, timeout=30)
    resp = api.post("/v1/batches", json={"env": "fixed-turns", "tasks": [{"turns": 3}, {"turns": 2}],
                                                 "group_size": 2, "max_turns": 4})
    assert resp.status_code == 201, resp.text
    batch_id = resp.json()["batch_id"]

    def done() -> dict[str, Any] | None:
        info = api.get(f"/v1/batches/{batch_id}").json()
        return info if info["done"] else None

    info = wait_for(done, 180, f"batch {batch_id} to finish")  # generous: CI machines are shared
    assert info is not None and info["num_trajectories"] == 4 and info["counts"].get("completed") == 4, info
    with psycopg.connect(libpq(database_url)) as conn:
        episode = conn.execute("SELECT id FROM episodes WHERE batch_id = %s LIMIT 1", (batch_id,)).fetchone()
    assert episode is not None
    read = api.get(f"/v1/episodes/{episode[0]}")  # turns, steps and trajectory: its SELECTs
    assert read.status_code == 200, read.text
    # a second batch cancelled by the scheduler's login (its UPDATE of batches and episodes)
    second = api.post("/v1/batches", json={"env": "fixed-turns", "tasks": [{"turns": 2}], "group_size": 1})
    assert second.status_code == 201, second.text
    assert api.post(f"/v1/batches/{second.json()['batch_id']}/cancel").status_code == 200
    # the exporter's login exports and follows through its cursor; the pruner's prunes the feed
    assert export_batch(logins["exporter"], batch_id, tmp_path).records == 4
    with TrajectoryReader(logins["exporter"], consumer="roles-test", start="earliest") as reader:
        got = reader.next_batch()
        assert got is not None and len(got) >= 1
        got.ack()
    prune(logins["feed-prune"])
    api.close()
    # and the recorder stored everything under its login: no dead letter, no failure
    with psycopg.connect(libpq(database_url)) as conn:
        assert conn.execute("SELECT count(*) FROM trajectories WHERE batch_id = %s", (batch_id,)).fetchone() == (4,)
        assert conn.execute("SELECT count(*) FROM dead_letters").fetchone() == (0,)
        assert conn.execute("SELECT count(*) FROM attempt_failures").fetchone() == (0,)


def test_the_db_logins_job_makes_each_login_from_its_services_dsn(database_url: str) -> None:
    from rollout_ledger.migrations.logins import LoginSettings, create_logins_from

    user = f"t_job_recorder_{uuid.uuid4().hex[:8]}"
    recorder = login_url(database_url, user, "job-made-password")
    settings = LoginSettings(database_url=database_url, recorder_database_url=recorder)
    try:
        assert create_logins_from(settings) == [user]
        assert create_logins_from(settings) == [user]  # idempotent: a rerun of the Job updates it
        with psycopg.connect(libpq(recorder)) as conn:
            assert conn.execute("SELECT pg_has_role(current_user, 'rollout_recorder', 'USAGE'), "
                                "pg_has_role(current_user, 'rollout_scheduler', 'USAGE')").fetchone() == (True, False)
        _refused(recorder, "DELETE FROM turns")
    finally:
        with psycopg.connect(libpq(database_url), autocommit=True) as conn:
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(user)))
