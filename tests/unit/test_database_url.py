"""Database URLs naming several hosts (a primary and its standbys, ``target_session_attrs=read-write``): what
``normalize_database_url`` makes of each spelling, what SQLAlchemy's psycopg dialect then hands the driver, the libpq
form the exporter's psycopg and ADBC connections use, Alembic's URL, and the errors for a URL that is neither."""

from __future__ import annotations

import psycopg
import pytest
from pydantic import ValidationError
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg, PGDialectAsync_psycopg
from sqlalchemy.engine import make_url

from rollout_ledger.migrations.logins import libpq
from rollout_ledger.migrations.runner import alembic_config, sync_url
from rollout_ledger.shared.kit.settings import (
    BaseServiceSettings,
    DatabaseSettings,
    libpq_database_url,
    normalize_database_url,
)

LIBPQ = "postgresql://rl:p%40ss@10.0.0.1:5432,10.0.0.2:5433/rollout?target_session_attrs=read-write&connect_timeout=5"
SQLA = ("postgresql+psycopg://rl:p%40ss@/rollout?host=10.0.0.1:5432&host=10.0.0.2:5433"
        "&target_session_attrs=read-write&connect_timeout=5")


def driver_args(url: str) -> dict[str, object]:
    """What the async psycopg dialect passes to ``psycopg.AsyncConnection.connect`` for ``url``."""
    _, params = PGDialectAsync_psycopg().create_connect_args(make_url(url))
    return dict(params)


def test_a_libpq_host_list_becomes_sqlalchemy_query_hosts() -> None:
    assert normalize_database_url(LIBPQ) == SQLA
    assert normalize_database_url(SQLA) == SQLA  # idempotent
    params = driver_args(normalize_database_url(LIBPQ))
    assert params["host"] == "10.0.0.1,10.0.0.2" and params["port"] == "5432,5433"
    assert params["target_session_attrs"] == "read-write" and params["password"] == "p@ss"
    assert params["dbname"] == "rollout" and params["user"] == "rl"


def test_hosts_without_ports_and_the_comma_form() -> None:
    assert normalize_database_url("postgres://u:p@a,b/db") == "postgresql+psycopg://u:p@/db?host=a&host=b"
    assert driver_args(normalize_database_url("postgres://u:p@a,b/db"))["host"] == "a,b"
    comma = "postgresql+psycopg://u:p@/db?host=a,b&port=1,2"
    assert normalize_database_url(comma) == comma
    assert driver_args(comma)["host"] == "a,b" and driver_args(comma)["port"] == "1,2"


def test_one_host_is_unchanged() -> None:
    assert normalize_database_url("postgres://u:p@db:5432/x?sslmode=require") == \
        "postgresql+psycopg://u:p@db:5432/x?sslmode=require"
    assert libpq_database_url("postgresql+psycopg://u:p@db:5432/x") == "postgresql://u:p@db:5432/x"


def test_libpq_form_lists_the_hosts_in_the_netloc() -> None:
    url = libpq_database_url(SQLA)
    assert url == LIBPQ
    assert libpq(SQLA) == LIBPQ  # `rollout db create-login(s)` connects with it
    info = psycopg.conninfo.conninfo_to_dict(url)  # parsed by libpq itself
    assert info["host"] == "10.0.0.1,10.0.0.2" and info["port"] == "5432,5433"
    assert info["target_session_attrs"] == "read-write" and info["password"] == "p@ss"
    single = libpq_database_url("postgresql+psycopg://u:p@/db?host=h:7")  # SQLAlchemy's host:port, one host
    assert psycopg.conninfo.conninfo_to_dict(single) == {"user": "u", "password": "p", "host": "h", "port": "7",
                                                         "dbname": "db"}
    socket_dir = "postgresql+psycopg://u@/db?host=/run/pg"
    assert libpq_database_url(socket_dir) == "postgresql://u@/db?host=/run/pg"


def test_alembic_gets_the_same_hosts() -> None:
    url = sync_url(LIBPQ)
    assert url == SQLA.replace("%", "%%")  # ConfigParser interpolation
    configured = alembic_config(LIBPQ).get_main_option("sqlalchemy.url")
    assert configured == SQLA
    _, params = PGDialect_psycopg().create_connect_args(make_url(configured))
    assert params["host"] == "10.0.0.1,10.0.0.2" and params["port"] == "5432,5433"


def test_settings_normalise_and_keep_every_host_when_tls_is_added(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATABASE_URL", LIBPQ)
    assert BaseServiceSettings().database_url == SQLA
    monkeypatch.setenv("ROLLOUT_DB_SSLMODE", "verify-full")
    params = driver_args(DatabaseSettings().database_url)
    assert params["host"] == "10.0.0.1,10.0.0.2" and params["port"] == "5432,5433"
    assert params["sslmode"] == "verify-full" and params["target_session_attrs"] == "read-write"


@pytest.mark.parametrize(("url", "message"), [
    ("postgresql://u:p@a:1,b:2/db?host=c", "either in the netloc"),
    ("postgresql://u:p@a:1,,b:2/db", "empty host"),
])
def test_a_malformed_host_list_is_refused_clearly(url: str, message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=message):
        normalize_database_url(url)
    monkeypatch.setenv("DATABASE_URL", url)
    with pytest.raises(ValidationError, match=message):
        BaseServiceSettings()


def test_host_ports_and_a_port_list_together_are_refused() -> None:
    with pytest.raises(ValueError, match="either with each host"):
        libpq_database_url("postgresql+psycopg://u:p@/db?host=a:1&host=b:2&port=3")
