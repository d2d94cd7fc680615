"""resume and keep: an attempt after the first carries recorded turns over (steps.reused_from, steps.env_state) and
says how it resumed (attempt_resumes); a turn carried across a weight swap in mode keep has versions per run
(turns.version_runs)

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-27 01:30:00

- ``steps.reused_from`` (nullable): set on a step a resumed attempt carried over from an earlier attempt, naming
  the recorded step it repeats; its ``turn_event_id`` names the recorded turn (no turn is generated twice).
- ``steps.env_state`` (jsonb, nullable): a ``snapshot`` env's state after the step (what a resumed attempt
  restores).
- ``turns.version_runs`` (jsonb, nullable): ``[[start, version], ...]`` of a turn a swap in mode ``keep``
  carried across two weight versions; the trajectory splits the turn's action range at each run (one version per
  action range, ``action_versions``).
- ``attempt_resumes``: one row per attempt after the first: how it resumed (replay, snapshot, agent_replay,
  restart), from which attempt, turns recorded, carried over and in flight, and why it fell back. The recorder
  inserts, the scheduler reads; ``rollout_reader`` reads it through 0003's default privileges.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = '0015'
down_revision = '0014'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("turns", sa.Column(
        "version_runs", postgresql.JSONB(), nullable=True,
        comment="[[start, version], ...] when the turn straddles a weight swap in mode keep (from id start on, "
                "sampled by version); null: every id by weight_version (migration 0015)"))
    op.add_column("steps", sa.Column(
        "reused_from", sa.String(256), nullable=True,
        comment="a resumed attempt carried this turn over: the recorded step it repeats (migration 0015)"))
    op.add_column("steps", sa.Column(
        "env_state", postgresql.JSONB(), nullable=True,
        comment="a snapshot env's state after this step (migration 0015)"))
    op.create_table(
        "attempt_resumes",
        sa.Column("episode_id", sa.String(128), sa.ForeignKey("episodes.id", ondelete="CASCADE",
                                                              name="fk_attempt_resumes_episode"), primary_key=True),
        sa.Column("attempt", sa.Integer(), primary_key=True),
        sa.Column("batch_id", sa.String(128), nullable=False),
        sa.Column("mode", sa.String(16), nullable=False, comment="replay | snapshot | agent_replay | restart"),
        sa.Column("from_attempt", sa.Integer(), nullable=False,
                  comment="the attempt whose recorded turns were read (0: none)"),
        sa.Column("turns_recorded", sa.Integer(), nullable=False,
                  comment="turns of that attempt recorded with their steps"),
        sa.Column("turns_reused", sa.Integer(), nullable=False,
                  comment="turns carried over at the start (an agent replay counts its steps' reused_from instead)"),
        sa.Column("turns_unstepped", sa.Integer(), nullable=False,
                  comment="turns of that attempt generated without a recorded step (generated again)"),
        sa.Column("reason", sa.Text(), nullable=False,
                  comment="why it fell back to restart, or what limited the reuse"),
        sa.Column("produced_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    )
    op.create_index("ix_attempt_resumes_batch", "attempt_resumes", ["batch_id"])
    op.execute("GRANT SELECT, INSERT ON attempt_resumes TO rollout_recorder")
    op.execute("GRANT SELECT ON attempt_resumes TO rollout_scheduler")


def downgrade() -> None:
    op.execute("REVOKE ALL ON attempt_resumes FROM rollout_recorder, rollout_scheduler")
    op.drop_index("ix_attempt_resumes_batch", table_name="attempt_resumes")
    op.drop_table("attempt_resumes")
    op.drop_column("steps", "env_state")
    op.drop_column("steps", "reused_from")
    op.drop_column("turns", "version_runs")
