"""the scheduler reads logprob audits (the trajectory viewer shows the trainer-vs-inference gap)

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-26 14:30:00

``rollout_scheduler`` gets SELECT on ``logprob_audits``: ``GET /v1/viewer/episodes/{id}`` shows an audited
trajectory's mean / p99 / max |trainer logprob - inference logprob|. Nothing else changes.
"""

from __future__ import annotations

from alembic import op

revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("GRANT SELECT ON logprob_audits TO rollout_scheduler")


def downgrade() -> None:
    op.execute("REVOKE SELECT ON logprob_audits FROM rollout_scheduler")
