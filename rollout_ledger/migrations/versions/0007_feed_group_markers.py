"""trajectory_feed: a marker entry when an episode ends without a trajectory (complete groups get delivered)

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-23 17:40:00

Why: a consumer with ``--complete-groups`` delivers a group in the read that takes the group's latest feed entry,
if the group is complete then. Feed entries came only from trajectories, so a group whose last member ended
without one (failed before its first turn, cancelled) never had a read in which it was complete: its other
members were passed over and never delivered. A row trigger on ``episodes`` now appends an entry with
``attempt = 0`` (no trajectory has attempt 0, so it announces no trajectory version and delivers nothing by
itself) when an episode becomes terminal without a trajectory, in the same transaction (episodes are created
``requested`` and end by an UPDATE; the recorder writes a trajectory before it ends its episode, in one
transaction, so an episode that ends with a trajectory gets no marker). ``rollout feed prune``
treats it as dead (no trajectory row with that attempt) once every consumer has passed it.
"""

from __future__ import annotations

from alembic import op

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None

TERMINAL = "('completed', 'truncated', 'aborted', 'failed', 'cancelled')"

MARKER = 0
"""``trajectory_feed.attempt`` of a marker entry."""


def upgrade() -> None:
    op.execute(f"""
CREATE FUNCTION rl_feed_episode_ended() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM trajectories t WHERE t.episode_id = NEW.id) THEN
        INSERT INTO trajectory_feed (xid, episode_id, attempt, group_id, batch_id)
        VALUES (pg_current_xact_id()::text::bigint, NEW.id, {MARKER}, NEW.group_id, NEW.batch_id);
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER episodes_feed_ended AFTER UPDATE OF status ON episodes FOR EACH ROW
    WHEN (NEW.status IN {TERMINAL} AND OLD.status NOT IN {TERMINAL})
    EXECUTE FUNCTION rl_feed_episode_ended();
COMMENT ON COLUMN trajectory_feed.attempt IS
    'the trajectory version this entry announces; 0: its episode ended without a trajectory (a group marker)';
""")


def downgrade() -> None:
    op.execute("DROP TRIGGER IF EXISTS episodes_feed_ended ON episodes; "
               "DROP FUNCTION IF EXISTS rl_feed_episode_ended()")
