"""exporter: trajectory feed and consumer cursors, reward scores, SQL views, the rollout_reader role

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23 04:10:00

- ``trajectory_feed``: one row per trajectory written or replaced, filled by statement-level triggers on
  ``trajectories`` in the writer's own transaction, stamped with its transaction id (``xid``). Consumers read
  entries with ``xid`` below their snapshot's xmin only, so an entry that commits late can never be skipped
  (see docs/export.md, "Consumer cursors"). Existing trajectories are backfilled.
- ``export_cursors``: a consumer's position in the feed.
- ``reward_scores``: re-scores per (episode, reward name, reward version).
- Views ``v_batch_progress``, ``v_trajectory_summary``, ``v_turn_stats``, ``v_failures`` (docs/sql.md).
- Role ``rollout_reader`` (NOLOGIN; cluster-wide, created once): SELECT on every table and view of this
  database (default privileges: also those later migrations create), INSERT/UPDATE on ``export_cursors`` only. ``ALTER ROLE rollout_reader LOGIN PASSWORD '...'`` to use it.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None

TERMINAL = "('completed', 'truncated', 'aborted', 'failed', 'cancelled')"

FEED_FUNCTIONS = """
CREATE FUNCTION rl_feed_trajectories_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO trajectory_feed (xid, episode_id, attempt, group_id, batch_id)
    SELECT pg_current_xact_id()::text::bigint, n.episode_id, n.attempt, n.group_id, n.batch_id
    FROM rl_new n ORDER BY n.episode_id;
    RETURN NULL;
END $$;

CREATE FUNCTION rl_feed_trajectories_replaced() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO trajectory_feed (xid, episode_id, attempt, group_id, batch_id)
    SELECT pg_current_xact_id()::text::bigint, n.episode_id, n.attempt, n.group_id, n.batch_id
    FROM rl_new n JOIN rl_old o ON o.episode_id = n.episode_id
    WHERE n.attempt IS DISTINCT FROM o.attempt ORDER BY n.episode_id;
    RETURN NULL;
END $$;

CREATE TRIGGER trajectories_feed_inserted AFTER INSERT ON trajectories
    REFERENCING NEW TABLE AS rl_new FOR EACH STATEMENT EXECUTE FUNCTION rl_feed_trajectories_inserted();
CREATE TRIGGER trajectories_feed_replaced AFTER UPDATE ON trajectories
    REFERENCING OLD TABLE AS rl_old NEW TABLE AS rl_new FOR EACH STATEMENT
    EXECUTE FUNCTION rl_feed_trajectories_replaced();
"""

VIEWS = {
    "v_batch_progress": f"""
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
    min(e.started_at) AS first_started_at, max(e.finished_at) AS last_finished_at
FROM batches b LEFT JOIN episodes e ON e.batch_id = b.id
GROUP BY b.id""",
    "v_trajectory_summary": """
SELECT t.episode_id, t.batch_id, t.group_id, t.env, t.attempt, t.status, t.failure_class, t.reward,
    t.num_turns, t.num_tokens, t.prompt_len, t.num_sampled_tokens,
    t.num_tokens - t.num_sampled_tokens AS num_context_tokens,
    t.num_segments, t.token_check, jsonb_array_length(t.drifts) AS num_drifts,
    (SELECT min(v) FROM unnest(e.weight_versions) v) AS min_weight_version,
    (SELECT max(v) FROM unnest(e.weight_versions) v) AS max_weight_version,
    e.started_at, e.finished_at, extract(epoch FROM e.finished_at - e.started_at)::float8 AS duration_s,
    t.created_at
FROM trajectories t JOIN episodes e ON e.id = t.episode_id""",
    "v_turn_stats": """
SELECT tu.episode_id, e.batch_id, e.env, tu.attempt, tu.turn_index, tu.worker_id, tu.engine, tu.weight_version,
    tu.prompt_len, cardinality(tu.token_ids) AS generated_tokens, tu.finish_reason, tu.queue_ms, tu.generate_ms,
    CASE WHEN tu.generate_ms > 0 THEN cardinality(tu.token_ids) * 1000.0 / tu.generate_ms END::float8
        AS tokens_per_s,
    tu.cached_tokens,
    CASE WHEN tu.prompt_len > 0 AND tu.cached_tokens IS NOT NULL
        THEN tu.cached_tokens::float8 / tu.prompt_len END AS cache_hit_ratio,
    tu.produced_at
FROM turns tu JOIN episodes e ON e.id = tu.episode_id
WHERE NOT tu.superseded""",
    "v_failures": """
WITH f AS (
    SELECT af.episode_id, af.failure_class, af.reason, af.retried, af.produced_at AS at FROM attempt_failures af
    UNION ALL
    SELECT e.id, coalesce(e.failure_class, 'unknown'), coalesce(e.failure_reason, ''), false,
        coalesce(e.finished_at, e.updated_at)
    FROM episodes e
    WHERE e.status = 'failed'
        AND NOT EXISTS (SELECT 1 FROM attempt_failures a WHERE a.episode_id = e.id AND NOT a.retried)
)
SELECT e.batch_id, e.env, f.failure_class, left(split_part(f.reason, E'\\n', 1), 200) AS reason,
    count(*) AS attempts, count(*) FILTER (WHERE NOT f.retried) AS episodes_failed,
    count(*) FILTER (WHERE f.retried) AS retried, min(f.at) AS first_seen, max(f.at) AS last_seen,
    min(f.episode_id) AS example_episode_id
FROM f JOIN episodes e ON e.id = f.episode_id
GROUP BY e.batch_id, e.env, f.failure_class, left(split_part(f.reason, E'\\n', 1), 200)""",
}

READER = "rollout_reader"


def upgrade() -> None:
    op.create_table(
        'trajectory_feed',
        sa.Column('seq', sa.BigInteger(), autoincrement=True, nullable=False, comment='insert order within a transaction'),
        sa.Column('xid', sa.BigInteger(), nullable=False,
                  comment='pg_current_xact_id() of the writing transaction: readers take only xid < snapshot xmin'),
        sa.Column('episode_id', sa.String(length=128), nullable=False),
        sa.Column('attempt', sa.Integer(), nullable=False, comment='the trajectory version this entry announces'),
        sa.Column('group_id', sa.String(length=160), nullable=False),
        sa.Column('batch_id', sa.String(length=128), nullable=False),
        sa.Column('logged_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.PrimaryKeyConstraint('seq'),
        comment='one row per trajectory written or replaced (filled by triggers on trajectories): consumer cursors',
    )
    op.create_index('ix_trajectory_feed_position', 'trajectory_feed', ['xid', 'seq'], unique=False)
    op.create_index('ix_trajectory_feed_group', 'trajectory_feed', ['group_id'], unique=False)
    op.create_table(
        'export_cursors',
        sa.Column('consumer', sa.String(length=128), nullable=False),
        sa.Column('xid', sa.BigInteger(), server_default=sa.text('0'), nullable=False,
                  comment='position: last feed entry taken'),
        sa.Column('seq', sa.BigInteger(), server_default=sa.text('0'), nullable=False),
        sa.Column('deliveries', sa.BigInteger(), server_default=sa.text('0'), nullable=False,
                  comment='batches delivered (numbers the files of `rollout export --follow`)'),
        sa.Column('delivered', sa.BigInteger(), server_default=sa.text('0'), nullable=False,
                  comment='records delivered'),
        sa.Column('selection', postgresql.JSONB(astext_type=sa.Text()), nullable=True,
                  comment='the selection the consumer was last served with'),
        sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.PrimaryKeyConstraint('consumer'),
    )
    op.create_table(
        'reward_scores',
        sa.Column('episode_id', sa.String(length=128), nullable=False),
        sa.Column('reward_name', sa.String(length=128), nullable=False),
        sa.Column('reward_version', sa.String(length=64), nullable=False),
        sa.Column('attempt', sa.Integer(), nullable=False, comment='the trajectory attempt that was scored'),
        sa.Column('score', sa.Float(), nullable=True),
        sa.Column('info', postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"),
                  nullable=False),
        sa.Column('scored_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.ForeignKeyConstraint(['episode_id'], ['episodes.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('episode_id', 'reward_name', 'reward_version'),
        comment='re-scores of stored trajectories by a named, versioned reward function (rollout rescore)',
    )
    op.create_index('ix_reward_scores_name', 'reward_scores', ['reward_name', 'reward_version'], unique=False)

    op.execute(FEED_FUNCTIONS)
    op.execute(
        "INSERT INTO trajectory_feed (xid, episode_id, attempt, group_id, batch_id) "
        "SELECT pg_current_xact_id()::text::bigint, episode_id, attempt, group_id, batch_id FROM trajectories "
        "ORDER BY created_at, episode_id"
    )
    for name, body in VIEWS.items():
        op.execute(f"CREATE VIEW {name} AS {body}")

    # The read-only role: cluster-wide, so create it once and tolerate a concurrent creator.
    op.execute(f"""
DO $$ BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{READER}') THEN
        CREATE ROLE {READER} NOLOGIN;
    END IF;
EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;
END $$""")
    op.execute(f"DO $$ BEGIN EXECUTE format('GRANT CONNECT ON DATABASE %I TO {READER}', current_database()); END $$")
    op.execute(f"GRANT USAGE ON SCHEMA public TO {READER}")
    op.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {READER}")
    # tables and views later migrations create (as the same user) are readable too
    op.execute(f"ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT SELECT ON TABLES TO {READER}")
    op.execute(f"GRANT INSERT, UPDATE ON export_cursors TO {READER}")


def downgrade() -> None:
    # The role is cluster-wide (other databases may use it): revoke what this database granted, keep the role.
    op.execute(f"""
DO $$ BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{READER}') THEN
        EXECUTE 'ALTER DEFAULT PRIVILEGES IN SCHEMA public REVOKE SELECT ON TABLES FROM {READER}';
        EXECUTE 'REVOKE ALL ON ALL TABLES IN SCHEMA public FROM {READER}';
        EXECUTE 'REVOKE USAGE ON SCHEMA public FROM {READER}';
        EXECUTE format('REVOKE CONNECT ON DATABASE %I FROM {READER}', current_database());
    END IF;
END $$""")
    for name in reversed(list(VIEWS)):
        op.execute(f"DROP VIEW IF EXISTS {name}")
    op.execute("DROP TRIGGER IF EXISTS trajectories_feed_replaced ON trajectories")
    op.execute("DROP TRIGGER IF EXISTS trajectories_feed_inserted ON trajectories")
    op.execute("DROP FUNCTION IF EXISTS rl_feed_trajectories_replaced()")
    op.execute("DROP FUNCTION IF EXISTS rl_feed_trajectories_inserted()")
    op.drop_index('ix_reward_scores_name', table_name='reward_scores')
    op.drop_table('reward_scores')
    op.drop_table('export_cursors')
    op.drop_index('ix_trajectory_feed_group', table_name='trajectory_feed')
    op.drop_index('ix_trajectory_feed_position', table_name='trajectory_feed')
    op.drop_table('trajectory_feed')
