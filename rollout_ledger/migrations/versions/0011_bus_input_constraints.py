"""bus input hardening: turns, steps and attempt failures belong to a stored episode, and rewards are finite

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-25 15:00:00

``turns.episode_id``, ``steps.episode_id`` and ``attempt_failures.episode_id`` reference ``episodes.id`` (ON DELETE
CASCADE, like trajectories): an event for an episode the scheduler never stored cannot leave an orphan row, even
past the recorder's own check. ``episodes.reward``, ``trajectories.reward`` and ``steps.reward`` refuse NaN and
+/-Infinity (Postgres ``float8`` stores both; a NaN reward makes every mean over it NaN).

The constraints are added ``NOT VALID``: they hold for every row written from now on, and an upgrade never fails
or deletes rows over orphans or non-finite rewards an older recorder stored (find them with the queries in
docs/architecture.md, "Hostile input").
"""

from __future__ import annotations

from alembic import op

revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None

FOREIGN_KEYS = (
    ("fk_turns_episode", "turns"),
    ("fk_steps_episode", "steps"),
    ("fk_attempt_failures_episode", "attempt_failures"),
)

FINITE = "{col} IS NULL OR {col} NOT IN ('NaN'::float8, 'Infinity'::float8, '-Infinity'::float8)"
"""Postgres orders NaN as equal to itself (unlike IEEE), so ``NOT IN`` catches it."""

CHECKS = (
    ("ck_episodes_reward_finite", "episodes", "reward"),
    ("ck_trajectories_reward_finite", "trajectories", "reward"),
    ("ck_steps_reward_finite", "steps", "reward"),
)


def upgrade() -> None:
    for name, table in FOREIGN_KEYS:
        op.execute(f"ALTER TABLE {table} ADD CONSTRAINT {name} FOREIGN KEY (episode_id) REFERENCES episodes (id) "
                   "ON DELETE CASCADE NOT VALID")
    for name, table, col in CHECKS:
        op.execute(f"ALTER TABLE {table} ADD CONSTRAINT {name} CHECK ({FINITE.format(col=col)}) NOT VALID")


def downgrade() -> None:
    for name, table, _ in reversed(CHECKS):
        op.drop_constraint(name, table)
    for name, table in reversed(FOREIGN_KEYS):
        op.drop_constraint(name, table)
