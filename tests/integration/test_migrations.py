"""The migrations build exactly the schema rollout_ledger/shared/db.py declares, and services refuse an older schema."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine

from rollout_ledger.migrations.runner import current, downgrade, sync_url, upgrade_stopping_at_expand
from rollout_ledger.shared.db import EXPAND_REVISION, SCHEMA_REVISION, check_schema, metadata
from rollout_ledger.shared.db import create_engine as create_async
from rollout_ledger.shared.errors import SchemaVersionError


def test_migrated_schema_matches_models(database_url: str) -> None:
    engine = create_engine(sync_url(database_url))
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), metadata)
    engine.dispose()
    assert diff == []


async def test_service_refuses_older_schema(database_url: str) -> None:
    engine = create_async(database_url)
    await check_schema(engine)  # at head: fine
    downgrade(database_url, "base")
    with pytest.raises(SchemaVersionError, match="rollout db upgrade"):
        await check_schema(engine)
    await engine.dispose()


async def test_the_migrations_job_stops_at_the_expand_revision_while_the_previous_release_may_write(
        database_url: str) -> None:
    """`rollout db upgrade --stop-at-expand`: a database of the previous release is expanded only, and this
    release's services run on it; the run after the rollout contracts it; a new database goes to head at once."""
    downgrade(database_url, "0016")
    assert upgrade_stopping_at_expand(database_url) == EXPAND_REVISION == current(database_url)
    engine = create_async(database_url)
    await check_schema(engine)  # this release's pods start on the expand revision
    assert upgrade_stopping_at_expand(database_url) == SCHEMA_REVISION == current(database_url)
    await check_schema(engine)
    await engine.dispose()
    downgrade(database_url, "base")
    assert upgrade_stopping_at_expand(database_url) == SCHEMA_REVISION
