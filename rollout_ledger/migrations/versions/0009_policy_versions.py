"""policy_versions and policy_worker_states: the policy versions a trainer announced, and each inference worker's
state with each of them

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-24 13:40:00

A version row is written once by ``POST /v1/policy/versions`` (idempotent on the version, versions only increase);
the scheduler mirrors the inference workers' reports from the ``rl_policy_workers`` KV bucket into
``policy_worker_states`` (one row per version and worker: announced, loading, serving, failed, retired).

Table ``logprob_audits``: per audited trajectory, how far the logprobs recomputed with the trainer's weights
(transformers) are from the stored inference logprobs on its sampled tokens (mean / p99 / max |delta|).

View ``v_trajectory_versions``: each trajectory's lowest and highest weight version, their span and whether its
tokens came from more than one version (from ``action_versions``, one version per action range).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "policy_versions",
        sa.Column("version", sa.Integer(), autoincrement=False, nullable=False,
                  comment="the policy (weight) version"),
        sa.Column("checkpoint", sa.Text(), nullable=False,
                  comment="where the weights are (a directory the workers can read)"),
        sa.Column("mode", sa.String(length=8), nullable=False,
                  comment="drain | abort | keep: how running engines swap to it"),
        sa.Column("notes", sa.Text(), server_default=sa.text("''"), nullable=False),
        sa.Column("request_hash", sa.String(length=64), nullable=False,
                  comment="of the announcing request (idempotent POST)"),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.CheckConstraint("version >= 0", name="ck_policy_versions_version"),
        sa.CheckConstraint("mode IN ('drain', 'abort', 'keep')", name="ck_policy_versions_mode"),
        sa.PrimaryKeyConstraint("version"),
    )
    op.create_table(
        "policy_worker_states",
        sa.Column("version", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("worker_id", sa.String(length=128), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False,
                  comment="announced | loading | serving | failed | retired"),
        sa.Column("error", sa.Text(), server_default=sa.text("''"), nullable=False, comment="why the load failed"),
        sa.Column("engine", sa.String(length=32), server_default=sa.text("''"), nullable=False),
        sa.Column("reported_at", sa.DateTime(timezone=True), nullable=False,
                  comment="the worker's time of the report"),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.CheckConstraint("state IN ('announced', 'loading', 'serving', 'failed', 'retired')",
                           name="ck_policy_worker_states_state"),
        sa.PrimaryKeyConstraint("version", "worker_id"),
    )
    op.create_index("ix_policy_worker_states_worker", "policy_worker_states", ["worker_id", "version"])
    op.create_table(
        "logprob_audits",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("episode_id", sa.String(length=128), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("batch_id", sa.String(length=128), nullable=False),
        sa.Column("source", sa.String(length=16), nullable=False,
                  comment="audit (rollout audit) | trainer (the trainer's own pass)"),
        sa.Column("checkpoint", sa.Text(), nullable=False, comment="the weights the logprobs were recomputed with"),
        sa.Column("engine", sa.String(length=64), nullable=False, comment="the engine(s) that sampled the trajectory"),
        sa.Column("min_version", sa.Integer(), nullable=True, comment="lowest weight version of its sampled tokens"),
        sa.Column("max_version", sa.Integer(), nullable=True, comment="highest weight version of its sampled tokens"),
        sa.Column("num_tokens", sa.Integer(), nullable=False, comment="sampled (loss-mask 1) tokens compared"),
        sa.Column("mean_abs_delta", sa.Float(), nullable=False,
                  comment="mean |recomputed - stored logprob| over them"),
        sa.Column("p99_abs_delta", sa.Float(), nullable=False),
        sa.Column("max_abs_delta", sa.Float(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ux_logprob_audits_key", "logprob_audits", ["episode_id", "attempt", "source", "checkpoint"],
                    unique=True)
    op.create_index("ix_logprob_audits_batch", "logprob_audits", ["batch_id"])
    op.execute("""
CREATE VIEW v_trajectory_versions AS
SELECT t.episode_id, t.batch_id, t.group_id, t.attempt, t.status, v.min_version, v.max_version,
       v.max_version - v.min_version AS version_span, v.versions > 1 AS mixed_versions
FROM trajectories t
CROSS JOIN LATERAL (
    SELECT min(x) AS min_version, max(x) AS max_version, count(DISTINCT x) AS versions
    FROM unnest(t.action_versions) AS x) v
""")


def downgrade() -> None:
    op.execute("DROP VIEW v_trajectory_versions")
    op.drop_index("ix_logprob_audits_batch", table_name="logprob_audits")
    op.drop_index("ux_logprob_audits_key", table_name="logprob_audits")
    op.drop_table("logprob_audits")
    op.drop_index("ix_policy_worker_states_worker", table_name="policy_worker_states")
    op.drop_table("policy_worker_states")
    op.drop_table("policy_versions")
