"""logprob audits keep every recomputed logprob (the viewer colours each sampled token by its audit gap)

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-26 18:00:00

``logprob_audits.token_logprobs`` (``real[]``, nullable): the logprob the audit recomputed for each sampled
(loss-mask 1) token of the trajectory, in sequence order, so ``token_logprobs[k]`` belongs to the k-th sampled token;
NaN where it was not recomputed. Rows written before this revision, or by a trainer that keeps only the aggregates,
leave it null. The roles' table grants (0012, 0013) already cover a new column.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("logprob_audits", sa.Column(
        "token_logprobs", postgresql.ARRAY(sa.REAL(), dimensions=1), nullable=True,
        comment="recomputed logprob of each sampled (loss-mask 1) token, in order; NaN: not recomputed"))


def downgrade() -> None:
    op.drop_column("logprob_audits", "token_logprobs")
