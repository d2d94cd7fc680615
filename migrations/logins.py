"""Login users of the per-service Postgres roles (migration 0012): created by the deployment, never by a service.

Each service connects as a login user of its own that is a member of its group role (``rollout_scheduler``,
``rollout_recorder``, ...), with a password from a secret. ``rollout db create-login`` (the k8s ``db-logins`` Job)
and the local stack (cli/stack/devstack.py) call :func:`create_login` with the owner's DSN after the migrations.
"""

from __future__ import annotations

import psycopg
from psycopg import sql
from sqlalchemy.engine import make_url

from rollout_ledger.shared.errors import InfraError
from rollout_ledger.shared.kit.settings import normalize_database_url

SERVICE_ROLES: dict[str, str] = {
    "scheduler": "rollout_scheduler",
    "recorder": "rollout_recorder",
    "exporter": "rollout_exporter",
    "feed-prune": "rollout_pruner",
    "scorer": "rollout_scorer",
}
"""The group role each workload logs in through (``scorer``: `rollout rescore` and `rollout audit`)."""


def libpq(url: str) -> str:
    """``url`` as a libpq DSN (no SQLAlchemy driver suffix)."""
    return normalize_database_url(url).replace("postgresql+psycopg://", "postgresql://", 1)


def create_login(owner_url: str, service: str, user: str, password: str) -> None:
    """Create (or update) the login ``user`` with ``password`` as a member of ``service``'s group role only."""
    role = SERVICE_ROLES.get(service)
    if role is None:
        raise InfraError(f"unknown service {service!r} for a database login; known: {', '.join(SERVICE_ROLES)}")
    if not password:
        raise InfraError(f"no password for the database login {user!r}")
    with psycopg.connect(libpq(owner_url), autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (user,)).fetchone() is not None
        verb = "ALTER" if exists else "CREATE"
        conn.execute(sql.SQL(verb + " ROLE {} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE INHERIT PASSWORD {}")
                     .format(sql.Identifier(user), sql.Literal(password)))
        conn.execute(sql.SQL("GRANT {} TO {}").format(sql.Identifier(role), sql.Identifier(user)))


def login_url(url: str, user: str, password: str) -> str:
    """``url`` (any DSN of the database) with ``user`` and ``password`` instead of its own credentials."""
    return make_url(normalize_database_url(url)).set(username=user, password=password).render_as_string(
        hide_password=False)
