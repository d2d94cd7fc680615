"""batches.context: the context policy of a batch's episodes (full history or a sliding window)

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23 04:20:00

Null for every existing batch (full history). The scheduler's outbox rebuilds work items from this row, so the
policy must live here, not only on the work item.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("batches", sa.Column("context", postgresql.JSONB(astext_type=sa.Text()), nullable=True,
                                       comment="context policy of every episode (null: full history)"))


def downgrade() -> None:
    op.drop_column("batches", "context")
