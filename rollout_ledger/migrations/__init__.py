"""Alembic migrations for the Rollout Ledger schema."""
