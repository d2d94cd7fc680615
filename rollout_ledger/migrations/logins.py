"""Login users of the per-service Postgres roles (migration 0012): created by the deployment, never by a service.

Each service connects as a login user of its own that is a member of its group role (``rollout_scheduler``,
``rollout_recorder``, ...), with a password from a secret. ``rollout db create-logins`` (the k8s ``db-logins`` Job:
each service's own DSN from the Secret names its user and password), ``rollout db create-login`` and the local stack
(cli/stack/devstack.py) call :func:`create_login` with the owner's DSN after the migrations.
"""

from __future__ import annotations

import psycopg
from psycopg import sql
from sqlalchemy.engine import make_url

from rollout_ledger.shared.errors import InfraError
from rollout_ledger.shared.kit.settings import BaseServiceSettings, libpq_database_url, normalize_database_url

SERVICE_ROLES: dict[str, str] = {
    "scheduler": "rollout_scheduler",
    "recorder": "rollout_recorder",
    "exporter": "rollout_exporter",
    "feed-prune": "rollout_pruner",
    "scorer": "rollout_scorer",
}
"""The group role each workload logs in through (``scorer``: `rollout rescore` and `rollout audit`)."""


def libpq(url: str) -> str:
    """``url`` as a libpq DSN (no SQLAlchemy driver suffix; several hosts in the netloc)."""
    return libpq_database_url(url)


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


class LoginSettings(BaseServiceSettings):
    """`rollout db create-logins` (the k8s ``db-logins`` Job): ``DATABASE_URL`` is the owner's DSN; each service's
    own DSN (the one its Deployment gets) names the login user and password to create as a member of its role."""

    scheduler_database_url: str = ""
    """The scheduler's DSN (its login joins ``rollout_scheduler``); empty: no login made."""
    recorder_database_url: str = ""
    """The recorder's DSN (``rollout_recorder``)."""
    exporter_database_url: str = ""
    """The exporter's DSN (``rollout_exporter``: read-only plus its cursors)."""
    feed_prune_database_url: str = ""
    """`rollout feed prune`'s DSN (``rollout_pruner``)."""
    scorer_database_url: str = ""
    """`rollout rescore` / `rollout audit`'s DSN (``rollout_scorer``)."""

    def service_urls(self) -> dict[str, str]:
        given = {"scheduler": self.scheduler_database_url, "recorder": self.recorder_database_url,
                 "exporter": self.exporter_database_url, "feed-prune": self.feed_prune_database_url,
                 "scorer": self.scorer_database_url}
        return {service: url for service, url in given.items() if url}


def create_logins_from(settings: LoginSettings) -> list[str]:
    """A login per service DSN of ``settings`` (its user and password), made with the owner's ``database_url``;
    the users made."""
    made = []
    for service, url in settings.service_urls().items():
        parsed = make_url(normalize_database_url(url))
        if not parsed.username or not parsed.password:
            raise InfraError(f"the {service} DSN names no user and password to create")
        create_login(settings.database_url, service, parsed.username, parsed.password)
        made.append(parsed.username)
    return made
