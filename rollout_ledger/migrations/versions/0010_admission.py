"""staleness bounded at admission: a batch's max_staleness and run-ahead, the waiting status, the version an
episode was admitted under, and which trajectories span more versions than their batch allows

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-25 12:00:00

``batches.max_staleness`` (k), ``batches.episodes_per_version`` (B) and ``batches.admission_base_version`` (the
announced version when the batch was stored) drive the scheduler's admission (services/scheduler/admission.py):
episodes of such a batch are stored ``waiting`` (no work item) and become ``requested`` when the bound lets them
start; ``episodes.admitted_version`` records the announced version at that moment. The partial index finds waiting
episodes without reading the others.

Views: ``v_batch_progress`` gains ``waiting``; ``v_trajectory_versions`` gains the batch's ``max_staleness`` and
``beyond_staleness`` (its tokens span more than k versions). Both are replaced with their old columns first, so
readers of the old columns see no change.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None

TERMINAL = "('completed', 'truncated', 'aborted', 'failed', 'cancelled')"

BATCH_PROGRESS = f"""
SELECT b.id AS batch_id, b.env, b.num_episodes, b.group_size, b.created_at, b.cancelled_at,
    count(e.id) FILTER (WHERE e.status = 'requested') AS requested,
    count(e.id) FILTER (WHERE e.status = 'running') AS running,
    count(e.id) FILTER (WHERE e.status = 'completed') AS completed,
    count(e.id) FILTER (WHERE e.status = 'truncated') AS truncated,
    count(e.id) FILTER (WHERE e.status = 'aborted') AS aborted,
    count(e.id) FILTER (WHERE e.status = 'failed') AS failed,
    count(e.id) FILTER (WHERE e.status = 'cancelled') AS cancelled,
    count(e.id) FILTER (WHERE e.status IN {TERMINAL}) AS terminal,
    round(count(e.id) FILTER (WHERE e.status IN {TERMINAL})::numeric / NULLIF(b.num_episodes, 0), 4)
        AS done_fraction,
    avg(e.reward) AS mean_reward,
    (SELECT count(*) FROM trajectories t WHERE t.batch_id = b.id) AS trajectories,
    count(DISTINCT e.group_id) AS groups,
    (SELECT count(*) FROM (SELECT 1 FROM episodes g WHERE g.batch_id = b.id GROUP BY g.group_id
        HAVING bool_and(g.status IN {TERMINAL})) c) AS groups_done,
    min(e.started_at) AS first_started_at, max(e.finished_at) AS last_finished_at{{extra}}
FROM batches b LEFT JOIN episodes e ON e.batch_id = b.id
GROUP BY b.id"""

TRAJECTORY_VERSIONS = """
SELECT t.episode_id, t.batch_id, t.group_id, t.attempt, t.status, v.min_version, v.max_version,
       v.max_version - v.min_version AS version_span, v.versions > 1 AS mixed_versions{extra}
FROM trajectories t
CROSS JOIN LATERAL (
    SELECT min(x) AS min_version, max(x) AS max_version, count(DISTINCT x) AS versions
    FROM unnest(t.action_versions) AS x) v{join}
"""


def upgrade() -> None:
    op.add_column("batches", sa.Column(
        "max_staleness", sa.Integer(), nullable=True,
        comment="k: an episode starts only while (current version - the version it would run on) <= k"))
    op.add_column("batches", sa.Column(
        "episodes_per_version", sa.Integer(), nullable=True,
        comment="B: run-ahead bound, at most (current - base + k + 1) x B episodes admitted"))
    op.add_column("batches", sa.Column(
        "admission_base_version", sa.Integer(), nullable=True,
        comment="the announced version when the batch was stored (the run-ahead's base)"))
    op.add_column("episodes", sa.Column(
        "admitted_version", sa.Integer(), nullable=True,
        comment="the announced version when admission let the episode start (null: not bounded)"))
    op.create_check_constraint("ck_batches_max_staleness", "batches", "max_staleness IS NULL OR max_staleness >= 0")
    op.create_check_constraint("ck_batches_episodes_per_version", "batches",
                               "episodes_per_version IS NULL OR episodes_per_version >= 1")
    op.create_index("ix_episodes_waiting", "episodes", ["batch_id"], postgresql_where=sa.text("status = 'waiting'"))
    op.execute("CREATE OR REPLACE VIEW v_batch_progress AS "
               + BATCH_PROGRESS.format(extra=",\n    count(e.id) FILTER (WHERE e.status = 'waiting') AS waiting"))
    op.execute("CREATE OR REPLACE VIEW v_trajectory_versions AS " + TRAJECTORY_VERSIONS.format(
        extra=(",\n       b.max_staleness, coalesce(v.max_version - v.min_version > b.max_staleness, false) "
               "AS beyond_staleness"),
        join="\nJOIN batches b ON b.id = t.batch_id"))


def downgrade() -> None:
    # CREATE OR REPLACE cannot drop columns: the views are made again as 0009 / 0003 left them
    op.execute("DROP VIEW v_trajectory_versions")
    op.execute("CREATE VIEW v_trajectory_versions AS " + TRAJECTORY_VERSIONS.format(extra="", join=""))
    op.execute("DROP VIEW v_batch_progress")
    op.execute("CREATE VIEW v_batch_progress AS " + BATCH_PROGRESS.format(extra=""))
    op.drop_index("ix_episodes_waiting", table_name="episodes")
    op.drop_constraint("ck_batches_episodes_per_version", "batches")
    op.drop_constraint("ck_batches_max_staleness", "batches")
    op.drop_column("episodes", "admitted_version")
    op.drop_column("batches", "admission_base_version")
    op.drop_column("batches", "episodes_per_version")
    op.drop_column("batches", "max_staleness")
