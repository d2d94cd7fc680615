"""segments of a trajectory, token check, drifts; attempt failures

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23 04:00:00

A trajectory may hold several segments (a new one starts where the context was re-rendered); existing rows are
one segment each. ``attempt_failures`` keeps every failed attempt with its class and reason.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('steps', sa.Column('drift', sa.String(length=32), nullable=True,
                                     comment="drift class when the turn's rendering did not extend the context"))
    op.add_column('steps', sa.Column('new_segment', sa.Boolean(), server_default=sa.text('false'), nullable=False,
                                     comment='observation_token_ids is the re-rendered context that starts a new '
                                             'segment'))
    op.add_column('trajectories', sa.Column(
        'segments', postgresql.ARRAY(sa.Integer(), dimensions=2), nullable=True,
        comment='[start, end) of each segment (a context the policy saw; one training sample each)'))
    op.execute("UPDATE trajectories SET segments = ARRAY[ARRAY[0, num_tokens]]")
    op.alter_column('trajectories', 'segments', nullable=False)
    op.add_column('trajectories', sa.Column('num_segments', sa.Integer(), server_default=sa.text('1'),
                                            nullable=False))
    op.add_column('trajectories', sa.Column(
        'token_check', sa.String(length=16), nullable=True,
        comment="ok: decode(ids) equals the chat template's rendering, per segment; mismatch; NULL: not checked"))
    op.add_column('trajectories', sa.Column(
        'drifts', postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'[]'::jsonb"), nullable=False,
        comment='turns whose rendering did not extend the context: [{"turn": t, "class": ...}]'))
    op.create_table(
        'attempt_failures',
        sa.Column('id', sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column('event_id', sa.String(length=256), nullable=False, comment='the EpisodeFailed event'),
        sa.Column('episode_id', sa.String(length=128), nullable=False),
        sa.Column('batch_id', sa.String(length=128), nullable=False),
        sa.Column('attempt', sa.Integer(), nullable=False),
        sa.Column('failure_class', sa.String(length=16), nullable=False,
                  comment='infra | inference | env | agent | timeout'),
        sa.Column('reason', sa.Text(), nullable=False),
        sa.Column('retried', sa.Boolean(), nullable=False,
                  comment="another attempt followed (the class's budget was not spent)"),
        sa.Column('produced_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('recorded_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('event_id'),
    )
    op.create_index('ix_attempt_failures_class', 'attempt_failures', ['failure_class', 'produced_at'], unique=False)
    op.create_index('ix_attempt_failures_episode', 'attempt_failures', ['episode_id'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_attempt_failures_episode', table_name='attempt_failures')
    op.drop_index('ix_attempt_failures_class', table_name='attempt_failures')
    op.drop_table('attempt_failures')
    op.drop_column('trajectories', 'drifts')
    op.drop_column('trajectories', 'token_check')
    op.drop_column('trajectories', 'num_segments')
    op.drop_column('trajectories', 'segments')
    op.drop_column('steps', 'new_segment')
    op.drop_column('steps', 'drift')
