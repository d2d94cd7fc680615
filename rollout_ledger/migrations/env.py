"""Alembic environment: migrates the database named by sqlalchemy.url (set by migrations/runner.py)."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool

from rollout_ledger.shared.db import metadata

config = context.config
target_metadata = metadata


def run_offline() -> None:
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata,
                      literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    url = config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("no database URL: use `rollout db upgrade` with DATABASE_URL set")
    engine = create_engine(url, poolclass=pool.NullPool)
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=target_metadata)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
