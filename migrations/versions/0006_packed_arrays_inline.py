"""trajectories.token_ids_le / logprobs_le stored inline (STORAGE MAIN): the exporter's read skips a TOAST fetch

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23 10:00:00

Why: a row holds the same tokens four ways (``token_ids`` / ``logprobs`` / ``weight_versions`` / ``loss_mask``,
the SQL surface, and the two packed copies the exporter reads). With every column EXTENDED, Postgres moved the
largest out of line first, and for short trajectories that was ``token_ids_le``: each exported row cost one TOAST
index lookup and heap fetch (~4.6 us of the server's time per row; 0.46 s of 100,000 trajectories of 256 tokens,
a quarter of the server's side of an export). With STORAGE MAIN on the packed copies, the toaster moves the
``int4[]`` / ``float4[]`` / ``int2[]`` columns out first and keeps the packed copies in the row (compressed if the
row is still too big) up to a whole page; longer trajectories still go out of line, where one fetch is spread
over more tokens. Rows already stored keep their layout until rewritten (``VACUUM FULL trajectories`` rewrites
them, under an exclusive lock).
"""

from __future__ import annotations

from alembic import op

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE trajectories ALTER COLUMN token_ids_le SET STORAGE MAIN, "
               "ALTER COLUMN logprobs_le SET STORAGE MAIN")


def downgrade() -> None:
    op.execute("ALTER TABLE trajectories ALTER COLUMN token_ids_le SET STORAGE EXTENDED, "
               "ALTER COLUMN logprobs_le SET STORAGE EXTENDED")
