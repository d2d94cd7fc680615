"""The migrations build exactly the schema shared/db.py declares, and services refuse an older schema."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine

from rollout_ledger.migrations.runner import downgrade, sync_url
from rollout_ledger.shared.db import check_schema, metadata
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
