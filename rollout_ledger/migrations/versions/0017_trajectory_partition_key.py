"""trajectories.episode_created_at: the key a time-partitioned trajectories table needs (expand; 0018 partitions)

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-28 03:00:00

A trajectory is replaced in place by a higher attempt of its episode (the recorder's upsert), so its partition key
must be a time that never changes for the row and is known to every writer before it writes: its episode's
``created_at`` (when the batch was stored). The recorder of this release upserts on ``(episode_id,
episode_created_at)``, which this revision's unique index serves while the table is still one table, and which
0018's primary key serves once it is partitioned.

This revision is the expand half: the previous release's recorder, still running during a rolling upgrade, writes
trajectories without the column (a trigger fills it from the episode) and upserts ``ON CONFLICT (episode_id)``
(the primary key stays). 0018 is the contract half: apply it once no pod of the previous release runs
(docs/deploy.md, "Upgrading").
"""

from __future__ import annotations

from alembic import op

revision = '0017'
down_revision = '0016'
branch_labels = None
depends_on = None

FILL = """
CREATE FUNCTION rl_trajectory_key() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.episode_created_at IS NULL THEN  -- a writer of the previous release: the key comes from the episode
        SELECT e.created_at INTO NEW.episode_created_at FROM episodes e WHERE e.id = NEW.episode_id;
    END IF;
    RETURN NEW;
END $$;
"""


def upgrade() -> None:
    op.execute("ALTER TABLE trajectories ADD COLUMN episode_created_at timestamptz")
    # no attempt changes: the feed's replacement trigger logs nothing for this update
    op.execute("UPDATE trajectories t SET episode_created_at = e.created_at FROM episodes e WHERE e.id = t.episode_id")
    op.execute("ALTER TABLE trajectories ALTER COLUMN episode_created_at SET NOT NULL")
    op.execute("COMMENT ON COLUMN trajectories.episode_created_at IS 'its episode''s created_at: the partition key "
               "(a replacement by a higher attempt keeps it)'")
    op.execute(FILL)
    op.execute("CREATE TRIGGER trajectories_key BEFORE INSERT ON trajectories FOR EACH ROW "
               "EXECUTE FUNCTION rl_trajectory_key()")
    op.execute("CREATE UNIQUE INDEX ux_trajectories_episode_key ON trajectories (episode_id, episode_created_at)")


def downgrade() -> None:
    op.execute("DROP INDEX IF EXISTS ux_trajectories_episode_key")
    op.execute("DROP TRIGGER IF EXISTS trajectories_key ON trajectories")
    op.execute("DROP FUNCTION IF EXISTS rl_trajectory_key()")
    op.execute("ALTER TABLE trajectories DROP COLUMN episode_created_at")
