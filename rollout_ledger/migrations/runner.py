"""Runs the Alembic migrations programmatically (`rollout db upgrade`), no alembic.ini needed."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory

HERE = Path(__file__).resolve().parent


def alembic_config(database_url: str | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(HERE))
    if database_url:
        cfg.set_main_option("sqlalchemy.url", sync_url(database_url))
    return cfg


def sync_url(database_url: str) -> str:
    """The same DSN for a synchronous psycopg 3 engine (Alembic runs synchronously)."""
    from rollout_ledger.shared.kit.settings import normalize_database_url

    return normalize_database_url(database_url).replace("%", "%%")


def head() -> str:
    rev = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if rev is None:
        raise RuntimeError("no migrations found in " + str(HERE / "versions"))
    return rev


def upgrade(database_url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(database_url), revision)


def current(database_url: str) -> str | None:
    """The database's revision (None: never migrated)."""
    from sqlalchemy import create_engine, text

    engine = create_engine(sync_url(database_url))
    try:
        with engine.connect() as conn:
            if conn.execute(text("select to_regclass('alembic_version')")).scalar() is None:
                return None
            return conn.execute(text("select version_num from alembic_version")).scalar()
    finally:
        engine.dispose()


def upgrade_stopping_at_expand(database_url: str) -> str:
    """Upgrade as the migrations Job of a rolling upgrade must; returns the revision reached.

    A database below this release's expand revision (``shared.db.EXPAND_REVISION``) is brought to it and no further:
    pods of the previous release may still write, and the contract revisions after it would break them. A database
    at or past it, or never migrated (no previous release runs), goes to head. So the first run of a release's Job
    expands, and the run after the rollout (docs/deploy.md, "Upgrading") contracts."""
    from rollout_ledger.shared.db import EXPAND_REVISION

    now = current(database_url)
    order = [r.revision for r in ScriptDirectory.from_config(alembic_config()).walk_revisions("base", "heads")]
    if now is not None and now in order and order.index(now) > order.index(EXPAND_REVISION):
        upgrade(database_url, EXPAND_REVISION)
        return EXPAND_REVISION
    upgrade(database_url)
    return head()


def downgrade(database_url: str, revision: str) -> None:
    command.downgrade(alembic_config(database_url), revision)


async def wait_for_schema(database_url: str, timeout_s: float, interval_s: float = 2.0) -> None:
    """Return once ``database_url`` is at this code's head revision; raise the last error after ``timeout_s``
    (``rollout db wait-schema``: the init container of every long-running workload that uses Postgres)."""
    import asyncio
    import sys
    import time

    from rollout_ledger.shared.db import check_schema, create_engine
    from rollout_ledger.shared.errors import RolloutError

    engine = create_engine(database_url, pool_size=1)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                await check_schema(engine)
                return
            except RolloutError as exc:
                if time.monotonic() >= deadline:
                    raise
                print(f"waiting for the schema: {exc}", file=sys.stderr, flush=True)
                await asyncio.sleep(interval_s)
    finally:
        await engine.dispose()
