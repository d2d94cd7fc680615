"""least privilege: one group role per service with only the grants its SQL needs

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-25 16:00:00

Group roles (``NOLOGIN``, cluster-wide, created once; the migrating role needs ``CREATEROLE`` the first time):

- ``rollout_scheduler``: batches and episodes (read, insert, update), policy versions (read, insert) and worker
  states (read, insert, update); reads turns, steps, trajectories and the views.
- ``rollout_recorder``: episodes (read, update: status, attempt, reward), turns and steps (read, insert, update of
  ``superseded``), trajectories (read, insert, update on replacement), attempt_failures and dead_letters (read,
  insert); reads batches; ``TEMP`` for its COPY staging tables.
- ``rollout_exporter``: a member of ``rollout_reader`` (0003: SELECT on everything, INSERT/UPDATE on
  ``export_cursors``), nothing more.
- ``rollout_pruner``: the exporter's reads plus DELETE on ``trajectory_feed`` (`rollout feed prune`).
- ``rollout_scorer``: the exporter's reads plus writes of ``reward_scores`` and ``logprob_audits``
  (`rollout rescore`, `rollout audit`).

Both writers also INSERT into ``trajectory_feed`` (the triggers on trajectories and on an episode's terminal status
run as the writer). Every role reads ``alembic_version`` (each service checks the schema revision at start).
Nobody but the owner (the role that runs the migrations) may DELETE, TRUNCATE, ALTER or DROP anything else: no
grant says so, ``PUBLIC`` loses its default ``TEMP`` and ``CREATE`` on this database and ``CREATE`` on schema
``public``. Login users are made by the deployment (``rollout db create-login``; the local stack and the k8s
``db-logins`` Job do it) as members of these roles. A later migration that adds a table grants it here too
(0013: the scheduler reads ``logprob_audits``).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None

READER = "rollout_reader"
"""0003's read-only role: SELECT on every table and view, INSERT/UPDATE on ``export_cursors``."""

VIEWS = ("v_batch_progress", "v_trajectory_versions")

GRANTS: dict[str, dict[str, str]] = {
    "rollout_scheduler": {
        "alembic_version": "SELECT",
        "batches": "SELECT, INSERT, UPDATE",
        "episodes": "SELECT, INSERT, UPDATE",
        "turns": "SELECT",
        "steps": "SELECT",
        "trajectories": "SELECT",
        "attempt_failures": "SELECT",
        "policy_versions": "SELECT, INSERT",
        "policy_worker_states": "SELECT, INSERT, UPDATE",
        "trajectory_feed": "INSERT",
        **{view: "SELECT" for view in VIEWS},
    },
    "rollout_recorder": {
        "alembic_version": "SELECT",
        "batches": "SELECT",
        "episodes": "SELECT, UPDATE",
        "turns": "SELECT, INSERT, UPDATE",
        "steps": "SELECT, INSERT, UPDATE",
        "trajectories": "SELECT, INSERT, UPDATE",
        "attempt_failures": "SELECT, INSERT",
        "dead_letters": "SELECT, INSERT",
        "trajectory_feed": "INSERT",
    },
    "rollout_pruner": {"trajectory_feed": "DELETE"},
    "rollout_scorer": {"reward_scores": "INSERT, UPDATE", "logprob_audits": "INSERT, UPDATE"},
}
"""Table (or view) privileges of each group role; the sequences of a table a role inserts into come with it."""

MEMBERS = {"rollout_exporter": READER, "rollout_pruner": READER, "rollout_scorer": READER}
"""Roles that read through ``rollout_reader``."""

ROLES = ("rollout_scheduler", "rollout_recorder", "rollout_exporter", "rollout_pruner", "rollout_scorer")

TEMP_USERS = ("rollout_recorder",)
"""Roles that make session-local staging tables (``CREATE TEMP TABLE``)."""


def _create_role(role: str) -> None:
    # cluster-wide: create it once, and let a concurrent migration of another database create it first
    op.execute(f"""
DO $$ BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{role}') THEN
        CREATE ROLE {role} NOLOGIN;
    END IF;
EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;
END $$""")


def _sequences(table: str) -> list[str]:
    rows = op.get_bind().execute(sa.text(
        "SELECT s.relname FROM pg_class s JOIN pg_depend d ON d.objid = s.oid AND d.deptype IN ('a', 'i') "
        "JOIN pg_class t ON t.oid = d.refobjid WHERE s.relkind = 'S' AND t.relname = :t"), {"t": table})
    return [str(r[0]) for r in rows]


def _on_database(sql: str) -> None:
    op.execute(f"DO $$ BEGIN EXECUTE format('{sql}', current_database()); END $$")


def upgrade() -> None:
    for role in (*ROLES, READER):
        _create_role(role)
    _on_database("REVOKE TEMPORARY, CREATE ON DATABASE %I FROM PUBLIC")
    op.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")
    for role in ROLES:
        _on_database(f"GRANT CONNECT ON DATABASE %I TO {role}")
        op.execute(f"GRANT USAGE ON SCHEMA public TO {role}")
    for role in TEMP_USERS:
        _on_database(f"GRANT TEMPORARY ON DATABASE %I TO {role}")
    for role, member_of in MEMBERS.items():
        op.execute(f"GRANT {member_of} TO {role}")
    for role, tables in GRANTS.items():
        for table, privileges in tables.items():
            op.execute(f"GRANT {privileges} ON {table} TO {role}")
            if "INSERT" in privileges:
                for seq in _sequences(table):
                    op.execute(f"GRANT USAGE ON SEQUENCE {seq} TO {role}")
    # the reader (0003) got SELECT by default privileges; alembic_version predates them on old databases
    op.execute(f"GRANT SELECT ON alembic_version TO {READER}")


def downgrade() -> None:
    # The roles are cluster-wide (other databases may use them): revoke what this database granted, keep them.
    for role, tables in GRANTS.items():
        for table in tables:
            op.execute(f"REVOKE ALL ON {table} FROM {role}")
            for seq in _sequences(table):
                op.execute(f"REVOKE ALL ON SEQUENCE {seq} FROM {role}")
    for role in ROLES:  # memberships are cluster-wide too: kept, like the roles
        op.execute(f"REVOKE USAGE ON SCHEMA public FROM {role}")
        _on_database(f"REVOKE ALL ON DATABASE %I FROM {role}")
    _on_database("GRANT TEMPORARY ON DATABASE %I TO PUBLIC")
