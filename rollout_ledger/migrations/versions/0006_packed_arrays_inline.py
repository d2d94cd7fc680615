"""trajectories.token_ids_le / logprobs_le stored inline (STORAGE MAIN): the exporter's read skips a TOAST fetch

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23 10:00:00

Why: a row holds the same tokens four ways (``token_ids`` / ``logprobs`` / ``weight_versions`` / ``loss_mask``,
the SQL surface, and the two packed copies the exporter reads). With every column EXTENDED, Postgres moved the
largest out of line first, and for short trajectories that was ``token_ids_le``: each exported row cost one TOAST
index lookup and heap fetch (~4.6 us of the server's time per row; 0.46 s of 100,000 trajectories of 256 tokens,
a quarter of the server's side of an export). With STORAGE MAIN on the packed copies and the other small
columns the exporter reads (``INLINE``), the toaster moves only the ``int4[]`` / ``float4[]`` / ``int2[]``
columns out and keeps the rest in the row (compressed if the row is still too big) up to a whole page; longer
trajectories still go out of line, where one fetch is spread over more tokens. Rows already stored keep their layout until rewritten (``VACUUM FULL trajectories`` rewrites
them, under an exclusive lock).
"""

from __future__ import annotations

from alembic import op

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


INLINE = ("episode_id", "batch_id", "group_id", "env", "status", "failure_class", "action_ranges", "segments",
          "token_check", "drifts", "token_ids_le", "logprobs_le", "action_versions")
"""Every variable-length column but the four per-token SQL arrays (token_ids, logprobs, loss_mask,
weight_versions): with only the packed copies MAIN, the toaster, unable to bring the row under its 2 kB target,
moved every EXTENDED value bigger than a TOAST pointer out of line, down to a 60-byte action_ranges (a TOAST
fetch per row for each; the export's server time doubled)."""


def upgrade() -> None:
    op.execute("ALTER TABLE trajectories " + ", ".join(f"ALTER COLUMN {c} SET STORAGE MAIN" for c in INLINE))


def downgrade() -> None:
    op.execute("ALTER TABLE trajectories " + ", ".join(f"ALTER COLUMN {c} SET STORAGE EXTENDED" for c in INLINE))
